"""Slice rendering for the viewer: pure numpy/Pillow, no Streamlit, so it can be timed and tested alone.

A loaded volume is turned once into a :class:`ViewVolume`: reoriented to the closest RAS voxel
order (flips and axis swaps only, no resampling), so that the three planes are axial, coronal and
sagittal whatever order the file stored its voxels in. Every slider move then only cuts one slice
per panel, windows it, blends the label colours and scales it to millimetres.

Display follows the radiological convention: axial and coronal panels show the patient's right on
the viewer's left, anterior is up in axial and left in sagittal, superior is up in coronal and
sagittal.
"""

from __future__ import annotations

from dataclasses import dataclass

import nibabel.orientations as nio
import numpy as np
from PIL import Image, ImageDraw

# (level, width) in Hounsfield units; the usual CT presets.
WINDOW_PRESETS: dict[str, tuple[float, float]] = {
    "Soft tissue": (40.0, 400.0),
    "Lung": (-600.0, 1500.0),
    "Bone": (400.0, 1800.0),
    "Brain": (40.0, 80.0),
}
PLANES = ("axial", "coronal", "sagittal")
# Distinct colours for labels 1, 2, ... (background 0 is never drawn).
PALETTE: tuple[tuple[int, int, int], ...] = (
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
    (210, 245, 60),
    (250, 190, 190),
)
CROSSHAIR = (255, 255, 0)


def label_colour(label: int) -> tuple[int, int, int]:
    """The overlay colour of a foreground label value."""
    return PALETTE[(label - 1) % len(PALETTE)]


def colour_hex(label: int) -> str:
    return "#{:02x}{:02x}{:02x}".format(*label_colour(label))


@dataclass
class ViewVolume:
    """A volume in RAS voxel order (x: left->right, y: posterior->anterior, z: inferior->superior)."""

    data: np.ndarray  # (X, Y, Z) float32, first channel of the image
    spacing: tuple[float, float, float]  # mm along x, y, z
    ornt: np.ndarray  # nibabel orientation transform from the stored order to RAS
    auto_window: tuple[float, float]  # (level, width) from the 1st and 99th percentiles

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.data.shape)  # type: ignore[return-value]


def to_view(array: np.ndarray, affine: np.ndarray) -> ViewVolume:
    """Reorient a stored (I, J, K) array to RAS voxel order; spacing from the affine's columns."""
    affine = np.asarray(affine, dtype=np.float64)
    ornt = nio.ornt_transform(nio.io_orientation(affine), nio.axcodes2ornt("RAS"))
    data = np.ascontiguousarray(nio.apply_orientation(np.asarray(array, dtype=np.float32), ornt))
    sizes = np.linalg.norm(affine[:3, :3], axis=0)
    spacing = [0.0, 0.0, 0.0]
    for src, (dst, _) in enumerate(ornt):
        spacing[int(dst)] = float(sizes[src])
    # a strided sample is enough for percentiles and keeps this fast on large volumes
    step = max(1, int(round((data.size / 2_000_000) ** (1 / 3))))
    lo, hi = np.percentile(data[::step, ::step, ::step], [1, 99])
    width = float(max(hi - lo, 1e-3))
    return ViewVolume(data, (spacing[0], spacing[1], spacing[2]), ornt, (float(lo + hi) / 2, width))


def labels_to_view(label: np.ndarray, view: ViewVolume) -> np.ndarray:
    """Reorient a label map stored like the image the view was made from."""
    out = np.ascontiguousarray(nio.apply_orientation(np.asarray(label), view.ornt)).astype(np.uint8)
    if out.shape != view.data.shape:
        raise ValueError(f"label map shape {out.shape} does not match the image {view.data.shape}")
    return out


def cut(volume: np.ndarray, plane: str, index: int) -> np.ndarray:
    """One slice of an (X, Y, Z) RAS array as a 2D screen array (rows top to bottom)."""
    if plane == "axial":  # rows: anterior at top; columns: patient's right on the left
        return volume[::-1, ::-1, index].T
    if plane == "coronal":  # rows: superior at top; columns: patient's right on the left
        return volume[::-1, index, ::-1].T
    if plane == "sagittal":  # rows: superior at top; columns: anterior on the left
        return volume[index, ::-1, ::-1].T
    raise ValueError(f"unknown plane {plane!r}; use one of {PLANES}")


def screen_spacing(view: ViewVolume, plane: str) -> tuple[float, float]:
    """(row height, column width) in mm of a slice's pixels."""
    sx, sy, sz = view.spacing
    return {"axial": (sy, sx), "coronal": (sz, sx), "sagittal": (sz, sy)}[plane]


def crosshair_on_screen(view: ViewVolume, plane: str, point: tuple[int, int, int]) -> tuple[int, int]:
    """(row, column) of the RAS voxel ``point`` on the screen array of ``plane``."""
    nx, ny, nz = view.shape
    x, y, z = point
    if plane == "axial":
        return ny - 1 - y, nx - 1 - x
    if plane == "coronal":
        return nz - 1 - z, nx - 1 - x
    return nz - 1 - z, ny - 1 - y


def window(slice2d: np.ndarray, level: float, width: float) -> np.ndarray:
    """Map intensities in [level - width/2, level + width/2] to 0..255 (uint8)."""
    width = max(float(width), 1e-6)
    scaled = (slice2d.astype(np.float32) - (level - width / 2)) * (255.0 / width)
    return np.clip(scaled, 0, 255).astype(np.uint8)


def render_slice(
    view: ViewVolume,
    plane: str,
    point: tuple[int, int, int],
    level: float,
    width: float,
    labels: np.ndarray | None = None,
    opacity: float = 0.4,
    crosshair: bool = True,
    max_side: int = 384,
) -> Image.Image:
    """Render one panel: windowed grey slice, label colours blended at ``opacity``, crosshair lines.

    The result is scaled so that one screen pixel has the same size in mm along rows and columns
    (anisotropic voxels keep their true aspect), with the longer side at most ``max_side`` pixels.
    """
    index = {"axial": point[2], "coronal": point[1], "sagittal": point[0]}[plane]
    grey = window(cut(view.data, plane, index), level, width)
    rgb = np.repeat(grey[:, :, None], 3, axis=2).astype(np.float32)
    if labels is not None and opacity > 0:
        lab = cut(labels, plane, index)
        present = [int(v) for v in np.unique(lab) if v != 0]
        if present:
            lut = np.zeros((256, 3), dtype=np.float32)
            for v in present:
                lut[v] = label_colour(v)
            mask = (lab > 0)[:, :, None]
            rgb = np.where(mask, rgb * (1 - opacity) + lut[lab] * opacity, rgb)
    rows, cols = grey.shape
    row_mm, col_mm = screen_spacing(view, plane)
    height_mm, width_mm = rows * row_mm, cols * col_mm
    scale = max_side / max(height_mm, width_mm)
    size = (max(1, round(width_mm * scale)), max(1, round(height_mm * scale)))
    img = Image.fromarray(rgb.astype(np.uint8), "RGB").resize(size, Image.Resampling.NEAREST)
    if crosshair:
        r, c = crosshair_on_screen(view, plane, point)
        y = (r + 0.5) * size[1] / rows
        x = (c + 0.5) * size[0] / cols
        draw = ImageDraw.Draw(img)
        draw.line([(0, y), (size[0], y)], fill=CROSSHAIR, width=1)
        draw.line([(x, 0), (x, size[1])], fill=CROSSHAIR, width=1)
    return img


def label_centre(labels: np.ndarray) -> tuple[int, int, int] | None:
    """The voxel at the centre of the foreground's bounding box (None when nothing is labelled)."""
    centre = []
    for axis in range(3):  # the box from each axis's profile: no index arrays of the whole foreground
        others = tuple(a for a in range(3) if a != axis)
        hit = np.flatnonzero(np.any(labels, axis=others))
        if hit.size == 0:
            return None
        centre.append(int((hit[0] + hit[-1]) // 2))
    return tuple(centre)  # type: ignore[return-value]
