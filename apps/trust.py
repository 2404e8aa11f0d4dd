"""Trust signals: is this input like what the model was trained on, and where were its metrics measured?

The facts come from the bundle (``configs/medseg.json``: the spacing the model resamples to, its
intensity window, its patch; ``configs/metadata.json``: the dataset's name and modality, case
counts, best epoch) and, when the training dataset's folder is on this machine, from its images'
NIfTI headers (spacing and field of view per case; headers only, no voxels are read).

Rules (each gives one warning; thresholds are deliberately loose, they catch "a different kind of
image", not small differences):

- modality: the input's DICOM Modality differs from the training dataset's; or a CT model gets an
  image whose 1st intensity percentile is above -200 (a CT in Hounsfield units has air at -1000
  in nearly every field of view);
- intensity: fewer than 5 % of the input's voxels fall inside the model's input window
  ``[w0, w1]`` (the model clips everything else to 0 or 1);
- spacing: along some RAS axis the input's voxel size is outside ``[s_min / 2, s_max * 2]``, with
  ``s_min..s_max`` the training images' range along that axis (the model's resampling spacing
  when the training headers are not available);
- field of view: along some RAS axis the input's extent (voxels x spacing, mm) is outside
  ``[e_min / 2, e_max * 2]`` of the training images' extents (not checked without their headers);
- synthetic training data: the training dataset calls itself synthetic.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import nibabel.orientations as nio
import numpy as np

from medseg.apps.registry import NOT_CT, ModelInfo, dataset_facts, is_synthetic, modality_code

log = logging.getLogger(__name__)

AXES = ("left-right", "front-back", "head-foot")
MAX_HEADERS = 200  # training headers read per dataset (enough for a range)
RANGE_FACTOR = 2.0
MIN_IN_WINDOW = 0.05


@dataclass(frozen=True)
class TrainingFacts:
    """What is known of the training images: per-axis (RAS) spacing and extent ranges, in mm."""

    name: str
    description: str
    synthetic: bool
    n_headers: int
    spacing: tuple[tuple[float, float], ...] | None  # ((min, max) along R, A, S)
    extent: tuple[tuple[float, float], ...] | None


def ras_spacing_extent(affine: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Voxel size and extent (mm) along the RAS axes closest to the voxel axes."""
    affine = np.asarray(affine, dtype=np.float64)
    sizes = np.linalg.norm(affine[:3, :3], axis=0)
    ornt = nio.io_orientation(affine)
    spacing, extent = np.zeros(3), np.zeros(3)
    for src, (dst, _) in enumerate(ornt):
        spacing[int(dst)] = sizes[src]
        extent[int(dst)] = sizes[src] * int(shape[src])
    return spacing, extent


def _resolve(info: ModelInfo) -> Path | None:
    if not info.data_dir:
        return None
    for root in (Path(info.data_dir), info.bundle.parent.parent.parent / info.data_dir):
        if (root / "dataset.json").is_file():
            return root
    return None


def training_facts(info: ModelInfo) -> TrainingFacts:
    """Training-set facts for ``info``'s model (header ranges only if its dataset folder is here)."""
    root = _resolve(info)
    facts = dataset_facts(root) if root else {}
    name = info.dataset_name or facts.get("name", "") or (Path(info.data_dir).name if info.data_dir else "")
    description = facts.get("description", "")
    spacings, extents = [], []
    if root is not None:
        try:
            items = json.loads((root / "dataset.json").read_text()).get("training", [])
        except (OSError, ValueError):
            items = []
        for item in items[:MAX_HEADERS]:
            path = item.get("image") if isinstance(item, dict) else None
            if not isinstance(path, str):
                continue
            try:
                img = nib.load(str(root / path))
                s, e = ras_spacing_extent(img.affine, img.shape[:3])
            except Exception as exc:  # noqa: BLE001 - a damaged training file only narrows the facts
                log.debug("training header %s not read: %s", path, exc)
                continue
            spacings.append(s)
            extents.append(e)

    def ranges(values: list[np.ndarray]) -> tuple[tuple[float, float], ...] | None:
        if not values:
            return None
        a = np.stack(values)
        return tuple((float(lo), float(hi)) for lo, hi in zip(a.min(0), a.max(0), strict=True))

    return TrainingFacts(
        name=name,
        description=description,
        synthetic=is_synthetic(name, description, info.data_dir),
        n_headers=len(spacings),
        spacing=ranges(spacings),
        extent=ranges(extents),
    )


def _mm(values) -> str:
    return " × ".join(f"{v:.3g}" for v in values)


def _outside(values: np.ndarray, ranges: tuple[tuple[float, float], ...]) -> list[int]:
    return [
        a
        for a, (v, (lo, hi)) in enumerate(zip(values, ranges, strict=True))
        if v < lo / RANGE_FACTOR or v > hi * RANGE_FACTOR
    ]


def _sample(data: np.ndarray) -> np.ndarray:
    """About 64 voxels along each axis of ``data`` (first channel, stored order), as float32."""
    shape = data.shape[:3]
    return np.asarray(
        data[:: max(1, shape[0] // 64), :: max(1, shape[1] // 64), :: max(1, shape[2] // 64)], np.float32
    )


def image_modality(data: np.ndarray, stored: str) -> str:
    """An image's modality: the one its file stores (DICOM's Modality), else, for a NIfTI file, CT
    when its intensities look like Hounsfield units (1st percentile at or below -200: air at -1000
    in nearly every CT field of view), else :data:`~medseg.apps.registry.NOT_CT`."""
    if modality_code(stored):
        return modality_code(stored)
    return "CT" if float(np.percentile(_sample(data), 1)) <= -200 else NOT_CT


def input_warnings(
    info: ModelInfo,
    facts: TrainingFacts,
    data: np.ndarray,
    affine: np.ndarray,
    modality: str,
    same_dataset: bool = False,
) -> list[str]:
    """Plain-language warnings where ``data`` (first channel, stored order) lies outside the training data."""
    out: list[str] = []
    shape = tuple(int(s) for s in data.shape[:3])
    spacing, extent = ras_spacing_extent(affine, shape)
    trained_on = facts.name or "its training data"
    if facts.synthetic and not same_dataset:
        out.append(
            f"This model was trained on synthetic images ({trained_on}), not on patient scans: "
            "its output on a real scan means nothing."
        )
    sample = _sample(data)
    p1 = float(np.percentile(sample, 1))
    want, given = modality_code(info.modality), modality_code(modality)  # "MRI" and "MR" are one
    if want and given and want != given:
        out.append(f"This is a {given} image; the model was trained on {want} ({trained_on}).")
    elif want == "CT" and not given and p1 > -200:
        out.append(
            "The intensities do not look like CT in Hounsfield units (almost nothing near air, -1000); "
            f"the model was trained on CT ({trained_on})."
        )
    if len(info.window) == 2:
        lo, hi = sorted(info.window)
        inside = float(((sample >= lo) & (sample <= hi)).mean())
        if inside < MIN_IN_WINDOW:
            out.append(
                f"Only {100 * inside:.1f} % of the voxels lie in the model's input window "
                f"({lo:g} … {hi:g}); it sees almost all of this image clipped to black or white."
            )
    if facts.spacing is not None:
        ref, source = (
            facts.spacing,
            f"the training images ({_mm(r[0] for r in facts.spacing)} to {_mm(r[1] for r in facts.spacing)} mm)",
        )
    else:
        ref, source = (
            tuple((s, s) for s in info.spacing),
            f"the model's working spacing ({_mm(info.spacing)} mm)",
        )
    bad = _outside(spacing, ref)
    if bad:
        out.append(
            f"Voxel size {_mm(spacing)} mm differs more than {RANGE_FACTOR:g}× from {source} "
            f"along the {', '.join(AXES[a] for a in bad)} axis."
        )
    if facts.extent is not None:
        bad = _outside(extent, facts.extent)
        if bad:
            lo = _mm(r[0] for r in facts.extent)
            hi = _mm(r[1] for r in facts.extent)
            out.append(
                f"Field of view {_mm(extent)} mm differs more than {RANGE_FACTOR:g}× from the training "
                f"images' ({lo} to {hi} mm) along the {', '.join(AXES[a] for a in bad)} axis."
            )
    return out


def facts_note(facts: TrainingFacts) -> str | None:
    """What could not be checked, or None when everything could."""
    if facts.extent is None:
        return (
            "The training images are not on this machine, so field of view was not compared and "
            "spacing was compared with the model's working spacing only."
        )
    return None


def metrics_source(info: ModelInfo, facts: TrainingFacts) -> str:
    """Where the sidebar's validation metrics were measured."""
    kind = "synthetic" if facts.synthetic else "not marked synthetic"
    cases = f"{info.n_val} validation case(s)" if info.n_val is not None else "its validation split"
    trained = f"; trained on {info.n_train} other case(s)" if info.n_train is not None else ""
    epoch = f", best epoch {info.best_epoch}" if info.best_epoch is not None else ""
    return f"Measured on {cases} of {facts.name or 'the training dataset'} ({kind} data){trained}{epoch}."


def evaluation_lines(info: ModelInfo) -> list[str]:
    """One line per ``medseg evaluate`` result found beside the bundle."""
    lines = []
    for ev in info.evaluations:
        kind = "synthetic" if ev["synthetic"] else "not marked synthetic"
        shown = ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in ev["summary"].items()
        )
        lines.append(
            f"{ev['dataset']} ({ev['folder']}, {ev['split']}, {ev['cases']} case(s), {kind}): {shown}"
        )
    return lines
