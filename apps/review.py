"""Review and correct: brush edits from the viewport, a second mask beside the model's, Dice per label.

The viewport reports a brush or eraser edit as runs over the label map in its stored voxel order
(the NIfTI's own i-fastest order, the order the model's label map was sent in): ``[start, length,
value]`` sets ``length`` voxels from flat index ``start`` to ``value``. :func:`apply_edits` turns
them into the corrected label map; the exports in :mod:`medseg.apps.export` then write it in the
scan's original geometry, like the model's own mask.

A second mask is an uploaded label file (:func:`read_mask`, checked against the scan's grid) or a
second model's result on the same case; :func:`dice_table` compares it with the model's.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import nibabel as nib
import numpy as np
from monai.data import MetaTensor

from medseg.apps import limits
from medseg.errors import DataError

MM_TOLERANCE = 0.01  # mm: how far two grids' voxel centres may differ and still count as the same grid


def apply_edits(label: np.ndarray, runs: Sequence[Sequence[int]]) -> np.ndarray:
    """A copy of the (I, J, K) ``label`` with ``runs`` ([start, length, value], flat i-fastest) set."""
    out = np.array(label, dtype=np.uint8, order="F", copy=True)
    flat = out.reshape(-1, order="F")  # a view: the array is Fortran-ordered
    n = flat.size
    for run in runs:
        start, length, value = (int(v) for v in run)
        if start < 0 or length < 0 or start + length > n or not 0 <= value <= 255:
            raise DataError("the viewer sent an edit outside this label map; reload the page and draw again")
        flat[start : start + length] = value
    return out


def edited_label(label: MetaTensor, runs: Sequence[Sequence[int]]) -> MetaTensor:
    """The model's (1, I, J, K) label map with the edits applied, on the same grid (same affine)."""
    fixed = apply_edits(label[0].cpu().numpy(), runs)
    meta = {k: v for k, v in label.meta.items() if k != "affine"}
    return MetaTensor(np.ascontiguousarray(fixed)[None], affine=label.affine, meta=meta)


def _spatial(shape: Sequence[int]) -> tuple[int, ...]:
    """A label map's shape without a trailing axis of 1 (a 4D file holding one volume)."""
    shape = tuple(int(s) for s in shape)
    return shape[:3] if len(shape) == 4 and shape[3] == 1 else shape


def _fits(shape: Sequence[int], want: tuple[int, ...]) -> bool:
    return _spatial(shape) == want


def _misfit(name: str, shape: Sequence[int], want: tuple[int, ...]) -> DataError:
    shape = _spatial(shape)
    return DataError(
        f"{name} does not fit this scan: it has {' × '.join(map(str, shape))} voxels, the scan "
        f"{' × '.join(map(str, want))}. Upload a mask made on this scan's own grid."
    )


def _load(name: str, data: bytes, want: tuple[int, ...]) -> nib.Nifti1Image:
    """The uploaded mask as a nibabel image. Its header is read first (no voxel inflated): a mask of
    another shape is refused there, and a ``.nii.gz`` is inflated no further than its header's size
    (:func:`medseg.apps.limits.gunzip_nifti`), so a gzip bomb stops within a megabyte of the scan's
    own size."""
    raw = data
    layout = limits.nifti_layout(limits.head(data))
    if layout is not None and not _fits(layout.shape, want):
        raise _misfit(name, layout.shape, want)
    if limits.is_gzip(raw):
        if layout is None:  # not inflated at all: nothing says how far it would go
            raise _not_nifti(name)
        raw = bytes(limits.gunzip_nifti(name, data, layout))
    try:
        return nib.Nifti1Image.from_stream(io.BytesIO(raw))
    except Exception:  # noqa: BLE001 - nibabel raises several kinds; the user needs one sentence
        try:
            return nib.Nifti2Image.from_stream(io.BytesIO(raw))
        except Exception:  # noqa: BLE001
            raise _not_nifti(name) from None


def _not_nifti(name: str) -> DataError:
    return DataError(f"{name} is not a NIfTI file; upload a label map saved as .nii or .nii.gz")


def read_mask(name: str, data: bytes, shape: Sequence[int], affine: np.ndarray) -> np.ndarray:
    """An uploaded label map as a uint8 (I, J, K) array on the scan's grid, or a DataError that says why not.

    The mask must have the scan's voxel grid: the same shape and an affine that puts every voxel
    within :data:`MM_TOLERANCE` of the scan's. Labels must be whole numbers from 0 to 255.
    """
    want = tuple(int(s) for s in shape)
    img = _load(name, data, want)
    if not _fits(img.shape, want):
        raise _misfit(name, img.shape, want)
    arr = np.asanyarray(img.dataobj)
    if arr.ndim == 4 and arr.shape[3] == 1:
        arr = arr[..., 0]
    a, b = np.asarray(img.affine, dtype=np.float64), np.asarray(affine, dtype=np.float64)
    corners = np.array(
        [[i, j, k, 1] for i in (0, want[0] - 1) for j in (0, want[1] - 1) for k in (0, want[2] - 1)]
    )
    shift = float(np.abs((corners @ a.T)[:, :3] - (corners @ b.T)[:, :3]).max())
    if shift > MM_TOLERANCE:
        raise DataError(
            f"{name} has this scan's size but lies elsewhere in the patient (its voxels are up to "
            f"{shift:.1f} mm away from the scan's; different origin, spacing or orientation). Upload "
            "a mask saved with this scan's geometry."
        )
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.isfinite(arr)) or not np.array_equal(arr, np.round(arr)):
            raise DataError(f"{name} holds fractional values; a label map holds whole label numbers")
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise DataError(f"{name} holds label numbers outside 0 … 255; it does not look like a label map")
    return np.asarray(arr, dtype=np.uint8)


def outline(label: np.ndarray, axes: Sequence[int] = (0, 1)) -> np.ndarray:
    """The label map's edges within each slice: voxels whose label differs from a neighbour's along
    ``axes`` (by default i and j, the scan's own slice plane); 0 elsewhere.

    The second mask is drawn this way so that the model's filled overlay stays visible under it.
    Edges in 3D would fill whole slices at a thin object's top and bottom.
    """
    lab = np.asarray(label)
    edge = np.zeros(lab.shape, dtype=bool)
    for axis in axes:
        ahead = np.diff(lab, axis=axis) != 0
        lo = [slice(None)] * lab.ndim
        hi = [slice(None)] * lab.ndim
        lo[axis], hi[axis] = slice(0, -1), slice(1, None)
        edge[tuple(lo)] |= ahead
        edge[tuple(hi)] |= ahead
    return np.where(edge & (lab > 0), lab, 0).astype(np.uint8)


def dice_table(a: np.ndarray, b: np.ndarray, labels: dict[int, str]) -> list[dict[str, Any]]:
    """Per foreground label: voxels in each mask and Dice 2|A∩B| / (|A| + |B|) (None when both are empty).

    Labels found in either mask but not named in ``labels`` are listed by number.
    """
    a, b = np.asarray(a), np.asarray(b)
    values = sorted(
        {int(k) for k in labels if int(k) != 0}
        | {int(v) for v in np.unique(a)}
        | {int(v) for v in np.unique(b)}
    )
    rows = []
    for v in values:
        if v == 0:
            continue
        in_a, in_b = a == v, b == v
        na, nb = int(in_a.sum()), int(in_b.sum())
        both = int(np.logical_and(in_a, in_b).sum())
        rows.append(
            {
                "label": labels.get(v, str(v)),
                "voxels A": na,
                "voxels B": nb,
                "Dice": (2.0 * both / (na + nb)) if na + nb else None,
            }
        )
    return rows
