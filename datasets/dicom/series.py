"""Single-frame series: one file per slice, stacked along the slice normal with checked geometry.

Slice k of the volume is the k-th file in order of its position along the normal n = r x c of the
row and column cosines; ``volume[:, :, k] = pixel_array.T``. Unlike MONAI's ``PydicomReader``, the
reader never averages uneven slice gaps: missing slices or uneven spacing raise
:class:`~medseg.errors.DataError` unless ``resample=True`` is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from pydicom.dataset import Dataset

from medseg.datasets.checks import check_memory
from medseg.datasets.dicom.header import RAS_LPS_FLIP, n_frames, optional_float, read_header
from medseg.datasets.dicom.scan import SeriesInfo
from medseg.errors import DataError

logger = logging.getLogger(__name__)

_SAME_TAGS = (
    "Rows",
    "Columns",
    "BitsAllocated",
    "BitsStored",
    "PixelRepresentation",
    "SamplesPerPixel",
    "PhotometricInterpretation",
    "FrameOfReferenceUID",
    "Modality",
)
# tags that tell acquisitions of one series apart (echoes, inversion times, cardiac or dynamic phases)
_ACQUISITION_TAGS = ("EchoNumbers", "EchoTime", "InversionTime", "TemporalPositionIdentifier")


class _Slice(NamedTuple):
    """One file of a series with its geometry tags (LPS, mm)."""

    path: Path
    ds: Dataset
    ipp: np.ndarray  # ImagePositionPatient of the first pixel
    iop: np.ndarray  # ImageOrientationPatient: row cosines, then column cosines
    ps: np.ndarray  # PixelSpacing: between rows, between columns


def _floats(ds: Dataset, path: Path, tag: str, n: int) -> np.ndarray:
    if tag not in ds or ds[tag].value is None or len(ds[tag].value) != n:
        raise DataError(f"{path} lacks the {tag} tag ({n} numbers); the slice geometry cannot be known")
    return np.array([float(v) for v in ds[tag].value], dtype=np.float64)


def _check_gaps(gaps: np.ndarray, pos: np.ndarray, tol: float, folder: Path) -> float:
    """Return the median gap; raise DataError unless every gap is within tolerance of it."""
    med = float(np.median(gaps))
    bad = np.abs(gaps - med) > np.maximum(tol * med, 1e-3)
    if not bad.any():
        return med
    n = np.rint(gaps / med)
    missing = bad & (n >= 2) & (np.abs(gaps - n * med) <= np.maximum(tol * gaps, 1e-3))
    if (bad == missing).all():
        problem = ", ".join(
            f"{int(n[g]) - 1} missing slice(s) between positions {pos[g]:.3f} and {pos[g + 1]:.3f} mm"
            for g in np.flatnonzero(missing)
        )
        problem += f" (regular gap {med:.4g} mm)"
    else:
        problem = f"uneven slice spacing: gaps {np.round(gaps, 4).tolist()} mm"
    raise DataError(
        f"DICOM series in {folder}: {problem}. This reader will not silently average the spacing "
        "(unlike MONAI's PydicomReader); pass resample=True (CLI --resample) to interpolate onto a "
        "regular grid, or supply the complete series"
    )


def _groups(slices: list[_Slice], key: Callable[[_Slice], Hashable]) -> dict[Any, list[Path]]:
    groups: dict[Any, list[Path]] = {}
    for item in slices:
        groups.setdefault(key(item), []).append(item.path)
    return groups


def _show_groups(groups: dict[Any, list[Path]]) -> str:
    return "; ".join(f"{k}: {len(v)} file(s), e.g. {v[0]}" for k, v in list(groups.items())[:4])


def _check_same_across_slices(slices: list[_Slice], where: str) -> None:
    """Every per-slice tag that changes voxel values or geometry must agree across the series."""
    for tag in _SAME_TAGS:
        groups = _groups(slices, lambda s, t=tag: str(s.ds.get(t, "(absent)")))
        if len(groups) > 1:
            raise DataError(
                f"{where}: {tag} differs between slices ({_show_groups(groups)}); the files are not one "
                "volume. Split the series or remove the odd files"
            )
    path0, _, _, iop0, ps0 = slices[0]
    for path, _, _, iop, ps in slices[1:]:
        if not np.allclose(iop, iop0, atol=1e-4):
            raise DataError(
                f"{where}: {path} and {path0} differ in ImageOrientationPatient; the series mixes "
                "geometries (a localizer?), split it or remove the odd files"
            )
        if not np.allclose(ps, ps0, rtol=1e-4, atol=1e-6):
            raise DataError(
                f"{where}: {path} and {path0} differ in PixelSpacing ({ps.tolist()} vs {ps0.tolist()}); the "
                "series mixes geometries, split it or remove the odd files"
            )
    for tag in ("RescaleSlope", "RescaleIntercept"):
        values = [optional_float(s.ds, s.path, tag) for s in slices]
        absent = [s.path for s, v in zip(slices, values, strict=True) if v is None]
        if absent and len(absent) < len(slices):
            present = next(s.path for s, v in zip(slices, values, strict=True) if v is not None)
            raise DataError(
                f"{where}: {absent[0]} has no {tag} but {present} has one ({len(absent)} of {len(slices)} "
                f"slices lack it); its voxel values would be on another scale. Repair or remove those files"
            )
    sops = _groups(slices, lambda s: str(s.ds.get("SOPInstanceUID", "")) or str(s.path))
    dup = next((v for v in sops.values() if len(v) > 1), None)
    if dup:
        raise DataError(
            f"{where}: {dup[0]} and {dup[1]} are the same image (one SOPInstanceUID); remove the copy"
        )


def _check_acquisitions(slices: list[_Slice], pos: np.ndarray, where: str) -> None:
    """Several acquisitions under one SeriesInstanceUID are refused, never merged into one volume.

    Slices must sit in one acquisition (same echo, inversion time, temporal position). Differing
    AcquisitionNumbers are accepted only when each number holds a contiguous run of positions (CT
    scanners number each rotation of an axial scan); interleaved or overlapping ones are refused.
    Duplicate positions and instance numbers are refused.
    """
    groups = _groups(slices, lambda s: tuple(str(s.ds.get(t, "")) for t in _ACQUISITION_TAGS))
    if len(groups) > 1:
        named = {
            ", ".join(f"{t}={v}" for t, v in zip(_ACQUISITION_TAGS, k) if v): v for k, v in groups.items()
        }
        raise DataError(
            f"{where}: holds {len(groups)} acquisitions under one SeriesInstanceUID ({_show_groups(named)}); "
            "medseg will not merge them into one volume. Put each acquisition in its own folder and read it alone"
        )
    numbers = [str(s.ds.get("AcquisitionNumber", "")) for s in slices]  # slices are sorted by position
    runs = [n for i, n in enumerate(numbers) if i == 0 or n != numbers[i - 1]]
    if len(set(runs)) != len(runs):
        groups = _groups(slices, lambda s: f"AcquisitionNumber {s.ds.get('AcquisitionNumber', '')}")
        raise DataError(
            f"{where}: holds {len(groups)} acquisitions whose slices interleave or overlap "
            f"({_show_groups(groups)}); medseg will not merge them into one volume. Put each acquisition in its "
            "own folder and read it alone"
        )
    if len(runs) > 1:
        logger.info("%s: AcquisitionNumbers %s cover consecutive slabs; read as one volume", where, runs)
    gaps = np.diff(pos)
    if np.any(gaps < 1e-3):
        g = int(np.flatnonzero(gaps < 1e-3)[0])
        raise DataError(
            f"{where}: {slices[g].path} and {slices[g + 1].path} share the slice position {pos[g]:.3f} mm; "
            "the folder mixes acquisitions (echoes, phases) or holds a copied slice: split it by series or "
            "remove duplicates"
        )
    numbers_i = _groups(slices, lambda s: str(s.ds.get("InstanceNumber", "")))
    dup = next((v for k, v in numbers_i.items() if k and len(v) > 1), None)
    if dup:
        raise DataError(
            f"{where}: {dup[0]} and {dup[1]} have the same InstanceNumber at different positions; the "
            "series mixes two acquisitions or renumbered copies. Split it or remove the odd files"
        )


def _check_series_memory(chosen: SeriesInfo, folder: Path) -> None:
    """Refuse a series whose volume would not fit in memory, judged from its first file's header."""
    first = read_header(chosen.files[0], headers_only=True)
    if first is not None and "Rows" in first and "Columns" in first:
        check_memory(
            int(first.Rows) * int(first.Columns) * len(chosen.files),
            max(int(first.get("BitsAllocated", 16) or 16) // 8, 1),
            f"DICOM series {chosen.uid} in {folder}",
        )


def _load_slices(files: list[Path]) -> list[_Slice]:
    """Read every file with its pixels and geometry tags, in the order given."""
    slices = []
    for path in files:
        ds = read_header(path, headers_only=False)
        if ds is None or any(tag not in ds for tag in ("Rows", "Columns", "PixelData")):
            raise DataError(f"{path} holds no image size or pixel data (truncated?); replace or remove it")
        if n_frames(ds) > 1:  # the headers said one frame, the whole file says more: changed meanwhile
            raise DataError(f"{path} is a multi-frame DICOM file inside a single-frame series; remove it")
        iop = _floats(ds, path, "ImageOrientationPatient", 6)
        ipp = _floats(ds, path, "ImagePositionPatient", 3)
        ps = _floats(ds, path, "PixelSpacing", 2)
        slices.append(_Slice(path, ds, ipp, iop, ps))
    return slices


def _decode_planes(slices: list[_Slice]) -> np.ndarray:
    """The float32 volume: each slice's ``pixel_array * RescaleSlope + RescaleIntercept``, transposed to (i, j)."""
    planes = []
    for path, ds, *_ in slices:
        try:
            pixels = ds.pixel_array.astype(np.float32)
        except Exception as e:  # decoders raise many kinds
            raise DataError(
                f"{path}: pixel data cannot be decoded ({e}); the file may be truncated, or its "
                "transfer syntax needs an extra decoder (pylibjpeg, gdcm)"
            ) from e
        slope, intercept = (
            optional_float(ds, path, "RescaleSlope"),
            optional_float(ds, path, "RescaleIntercept"),
        )
        slope, intercept = 1.0 if slope is None else slope, 0.0 if intercept is None else intercept
        planes.append((pixels * np.float32(slope) + np.float32(intercept)).T)
    return np.stack(planes, axis=2).astype(np.float32)


def _single_slice_spacing(path: Path, ds: Dataset) -> float:
    """Slice spacing of a series of one: SliceThickness, else SpacingBetweenSlices, else 1 mm."""
    spacing = ds.get("SliceThickness") or ds.get("SpacingBetweenSlices")
    if not spacing:
        logger.warning("%s: single slice without SliceThickness; slice spacing set to 1.0 mm", path)
    return float(spacing or 1.0)


def _resample_linear(volume: np.ndarray, pos: np.ndarray, folder: Path) -> tuple[np.ndarray, float]:
    """Interpolate slices at sorted positions ``pos`` linearly onto a regular grid; return (volume, spacing).

    The grid runs from pos[0] to pos[-1] with round((pos[-1] - pos[0]) / median gap) + 1 slices.
    Grid point g between pos[h-1] and pos[h] takes ``(1 - w) * slice[h-1] + w * slice[h]`` with
    ``w = (g - pos[h-1]) / (pos[h] - pos[h-1])``.
    """
    n_out = int(round((pos[-1] - pos[0]) / float(np.median(np.diff(pos))))) + 1
    grid = np.linspace(pos[0], pos[-1], n_out)
    hi = np.clip(np.searchsorted(pos, grid, side="right"), 1, len(pos) - 1)
    w = ((grid - pos[hi - 1]) / (pos[hi] - pos[hi - 1])).astype(np.float32)
    volume = volume[:, :, hi - 1] * (1 - w) + volume[:, :, hi] * w
    spacing = float(grid[1] - grid[0])
    logger.warning(
        "%s: uneven slice positions resampled linearly onto %d slices at %.4g mm",
        folder,
        n_out,
        spacing,
    )
    return volume, spacing


def _regular_slices(
    volume: np.ndarray,
    pos: np.ndarray,
    *,
    where: str,
    folder: Path,
    skipped: list[Path],
    resample: bool,
    spacing_tolerance: float,
) -> tuple[np.ndarray, float, bool]:
    """Check the gaps between sorted slice positions; return (volume, spacing, resampled).

    Uneven or missing slices raise DataError, unless ``resample`` is set and the folder holds no
    skipped file that might be the missing slice: then the volume is resampled linearly.
    """
    try:
        return volume, _check_gaps(np.diff(pos), pos, spacing_tolerance, folder), False
    except DataError:
        if not resample:
            raise
        if skipped:
            raise DataError(
                f"{where}: slices are missing or unevenly spaced, and the folder holds {len(skipped)} "
                f"file(s) that are not slices of this series (e.g. {skipped[0]}); a missing slice may "
                "be among them, so --resample will not interpolate it. Remove those files or repair them"
            ) from None
    volume, spacing = _resample_linear(volume, pos, folder)
    return volume, spacing, True


def _slice_step(
    ipps: np.ndarray, n_slices: int, normal: np.ndarray, spacing: float, folder: Path
) -> np.ndarray:
    """The affine's k column (LPS): ``normal * spacing`` unless the slice positions drift in-plane.

    The mean step between first and last position is kept when it differs from ``normal * spacing``
    by 1e-3 mm or more (gantry tilt), so that the affine keeps the shear.
    """
    step = (ipps[-1] - ipps[0]) / (n_slices - 1)
    if np.linalg.norm(step - normal * spacing) < 1e-3:
        return normal * spacing
    logger.warning("%s: slice positions drift in-plane (gantry tilt); the affine keeps the shear", folder)
    return step


def read_slices(
    chosen: SeriesInfo, folder: Path, skipped: list[Path], resample: bool, spacing_tolerance: float
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Stack the single-frame files of one series along their slice normal, with every check.

    Returns (float32 volume indexed (i, j, k), RAS affine 4x4, meta dict). ``skipped`` are the files of
    the folder that belong to no series; with any of them ``resample`` is refused.
    """
    _check_series_memory(chosen, folder)
    slices = _load_slices(chosen.files)
    where = f"DICOM series {chosen.uid} in {folder}"
    _check_same_across_slices(slices, where)
    path0, ds0, _, iop0, ps0 = slices[0]
    row_dir, col_dir = iop0[:3] / np.linalg.norm(iop0[:3]), iop0[3:] / np.linalg.norm(iop0[3:])
    normal = np.cross(row_dir, col_dir)
    slices.sort(key=lambda s: float(s.ipp @ normal))
    pos = np.array([float(s.ipp @ normal) for s in slices])
    ipps = np.array([s.ipp for s in slices])
    _check_acquisitions(slices, pos, where)
    volume = _decode_planes(slices)

    resampled = False
    if len(slices) == 1:
        spacing = _single_slice_spacing(path0, ds0)
        step = normal * spacing
    else:
        volume, spacing, resampled = _regular_slices(
            volume,
            pos,
            where=where,
            folder=folder,
            skipped=skipped,
            resample=resample,
            spacing_tolerance=spacing_tolerance,
        )
        step = _slice_step(ipps, volume.shape[2], normal, spacing, folder)

    lps = np.eye(4)
    lps[:3, 0], lps[:3, 1], lps[:3, 2] = row_dir * ps0[1], col_dir * ps0[0], step
    lps[:3, 3] = ipps[0]
    meta: dict[str, Any] = {
        "spacing": [float(ps0[1]), float(ps0[0]), float(spacing)],
        "modality": str(ds0.get("Modality", "")),
        "series_uid": chosen.uid,
        "series_description": chosen.description,
        "n_slices": int(volume.shape[2]),
        "n_files": len(slices),
        "resampled": resampled,
        "filename_or_obj": str(folder),
    }
    return np.ascontiguousarray(volume, dtype=np.float32), RAS_LPS_FLIP @ lps, meta
