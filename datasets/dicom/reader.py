"""DICOM series I/O with checked geometry.

Volumes are indexed (i, j, k) with a 4x4 voxel-to-world affine in RAS (the NIfTI/MONAI convention).
DICOM stores LPS, so ``LPS = diag(-1, -1, 1) @ RAS``. Slice k of a volume is one DICOM image whose
column index is i and row index is j: ``pixel_array = volume[:, :, k].T``.

Unlike MONAI's ``PydicomReader``, the reader never averages uneven slice gaps: missing slices or
uneven spacing raise :class:`~medseg.errors.DataError` unless ``resample=True`` is asked for.

Enhanced and Legacy Converted Enhanced CT/MR images (one file, every frame, geometry per frame in
functional groups) are read by :func:`read_multiframe`, from the file's path or from a folder whose
series is that one file; k then runs along the slice normal as well.
"""

from __future__ import annotations

import logging
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
from monai.data import ImageReader
from monai.utils import MetaKeys, SpaceKeys
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.errors import InvalidDicomError
from pydicom.uid import (
    CTImageStorage,
    EnhancedCTImageStorage,
    EnhancedMRImageStorage,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    LegacyConvertedEnhancedCTImageStorage,
    LegacyConvertedEnhancedMRImageStorage,
    generate_uid,
)
from pydicom.valuerep import format_number_as_ds

from medseg.datasets.checks import check_input_path, check_memory, prepare_output_dir, prepare_output_file
from medseg.datasets.nifti import save_nifti
from medseg.errors import DataError

logger = logging.getLogger(__name__)

_FLIP = np.diag([-1.0, -1.0, 1.0, 1.0])  # RAS <-> LPS (its own inverse)
_INT16_MIN, _INT16_MAX = -32768, 32767
_UID_RE = re.compile(r"[0-9]+(\.[0-9]+)+")


def _ds(x: float) -> str:
    """A decimal string that fits the 16 characters DICOM allows."""
    return format_number_as_ds(float(x))


def _rescale(volume: np.ndarray) -> tuple[float, float]:
    """Choose (slope, intercept) so that ``round((v - intercept) / slope)`` fits int16.

    Integer-valued data whose range spans at most 65535 keeps slope 1 (lossless; intercept 0 when the
    values already fit int16). Other data spreads its range over the int16 codes, so the quantisation
    error is at most slope / 2 = (max - min) / 131068. Both numbers are rounded to their DICOM decimal
    string first, so the values written are exactly the ones used to quantise.
    """
    volume = np.asarray(volume, dtype=np.float64)
    lo, hi = float(volume.min()), float(volume.max())
    if np.all(np.mod(volume, 1) == 0) and hi - lo <= _INT16_MAX - _INT16_MIN:
        fits = lo >= _INT16_MIN and hi <= _INT16_MAX
        return 1.0, 0.0 if fits else float(lo - _INT16_MIN)
    slope = float(_ds((hi - lo) / 65534.0)) if hi > lo else 1.0
    intercept = float(_ds(lo + 32767.0 * slope)) if hi > lo else float(_ds(lo))
    return slope, intercept


def _series_header(
    modality: str, description: str, patient_id: str, study_uid: str | None, series_uid: str
) -> Dataset:
    """The tags shared by every slice of a written CT Image Storage series."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = CTImageStorage
    ds.PatientName, ds.PatientID, ds.PatientBirthDate, ds.PatientSex = patient_id, patient_id, "", ""
    ds.StudyInstanceUID, ds.SeriesInstanceUID = study_uid or generate_uid(), series_uid
    ds.FrameOfReferenceUID, ds.PositionReferenceIndicator = generate_uid(), ""
    ds.StudyDate = ds.StudyTime = ds.ReferringPhysicianName = ds.AccessionNumber = ds.KVP = ""
    ds.StudyID, ds.SeriesNumber, ds.AcquisitionNumber = "1", 1, 1
    ds.Modality, ds.SeriesDescription, ds.Manufacturer = modality, description, "medseg"
    ds.ImageType = ["DERIVED", "SECONDARY", "AXIAL"]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
    return ds


def write_dicom_series(
    volume: np.ndarray,
    affine: np.ndarray,
    out_dir: str | Path,
    *,
    modality: str = "CT",
    series_description: str = "medseg",
    patient_id: str = "ANON",
    series_uid: str | None = None,
    study_uid: str | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write a 3D volume with a RAS affine as a CT Image Storage series, one file per slice k.

    Pixels are int16 with RescaleSlope/RescaleIntercept (see ``_rescale``). Each file goes to a
    temporary name first; with ``overwrite=True`` older ``*.dcm`` files in ``out_dir`` are replaced.
    """
    out_dir = Path(out_dir)
    volume = np.asarray(volume)
    affine = np.asarray(affine, dtype=np.float64)
    if volume.ndim != 3 or min(volume.shape) < 1:
        raise DataError(f"write_dicom_series needs a 3D volume, got shape {volume.shape} for {out_dir}")
    if affine.shape != (4, 4) or not np.all(np.isfinite(affine)):
        raise DataError(f"write_dicom_series needs a finite 4x4 affine for {out_dir}, got {affine.tolist()}")
    if not np.all(np.isfinite(volume)):
        raise DataError(f"the volume for {out_dir} holds NaN or infinite values; replace them before writing")
    lps = _FLIP @ affine
    sp_i, sp_j, sp_k = (float(np.linalg.norm(lps[:3, n])) for n in range(3))
    if min(sp_i, sp_j, sp_k) <= 0:
        raise DataError(f"the affine for {out_dir} has a zero-length axis: {affine.tolist()}")
    row_dir, col_dir = lps[:3, 0] / sp_i, lps[:3, 1] / sp_j
    if abs(float(row_dir @ col_dir)) > 1e-4:
        raise DataError(f"the affine for {out_dir} shears the i/j plane, which DICOM cannot store")
    if abs(float(np.cross(row_dir, col_dir) @ lps[:3, 2])) < 1e-6 * sp_k:
        raise DataError(f"the affine for {out_dir} puts the k axis inside the slice plane")

    prepare_output_dir(out_dir, what="DICOM series")
    old = [p for p in out_dir.iterdir() if p.is_file() and p.suffix.lower() == ".dcm"]
    if old and not overwrite:
        raise DataError(
            f"{out_dir} already holds {len(old)} .dcm file(s); choose an empty folder or pass overwrite=True"
        )
    slope, intercept = _rescale(volume)
    stored = np.clip(np.rint((volume.astype(np.float64) - intercept) / slope), _INT16_MIN, _INT16_MAX)
    stored = stored.astype("<i2")
    series_uid = series_uid or generate_uid()
    ds = _series_header(modality, series_description, patient_id, study_uid, series_uid)
    ds.ImageOrientationPatient = [_ds(v) for v in (*row_dir, *col_dir)]
    ds.PixelSpacing = [_ds(sp_j), _ds(sp_i)]
    # separation of consecutive slices along the slice normal
    ds.SliceThickness = ds.SpacingBetweenSlices = _ds(abs(float(np.cross(row_dir, col_dir) @ lps[:3, 2])))
    ds.Rows, ds.Columns = volume.shape[1], volume.shape[0]
    ds.RescaleSlope, ds.RescaleIntercept = _ds(slope), _ds(intercept)

    tmp_paths: list[Path] = []
    final_paths: list[Path] = []
    try:
        for k in range(volume.shape[2]):  # one header, updated per slice
            ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
            ds.InstanceNumber = k + 1
            ds.ImagePositionPatient = [_ds(v) for v in (lps @ [0.0, 0.0, k, 1.0])[:3]]
            ds.PixelData = np.ascontiguousarray(stored[:, :, k].T).tobytes()
            final = out_dir / f"slice_{k:04d}.dcm"
            tmp = out_dir / f".{final.name}.tmp"
            ds.save_as(tmp, enforce_file_format=True)
            tmp_paths.append(tmp)
            final_paths.append(final)
    except BaseException:
        for tmp in tmp_paths:
            tmp.unlink(missing_ok=True)
        raise
    for p in old:
        if p not in final_paths:
            p.unlink()
    for tmp, final in zip(tmp_paths, final_paths, strict=True):
        os.replace(tmp, final)
    logger.info("wrote %d DICOM slices (series %s) to %s", len(final_paths), series_uid, out_dir)
    return final_paths


@dataclass
class SeriesInfo:
    """One image series found in a folder."""

    uid: str
    description: str
    modality: str
    n_files: int
    files: list[Path] = field(default_factory=list)
    multiframe: list[Path] = field(default_factory=list)  # files holding more than one frame


_IMAGE_TAGS = ("SOPClassUID", "SeriesInstanceUID", "Rows")


def is_dicom_bytes(head: bytes) -> bool:
    """True for the start of a DICOM file: "DICM" at byte 128, or (no preamble) a first element of group 0002 or 0008.

    Scanners and PACS exports often write files without the 128-byte preamble; every image must hold
    group 0008 elements (SOPClassUID), so such a file starts with a tag of group 0002 or 0008, stored
    little endian or (retired Explicit VR Big Endian, still found in archives) big endian.
    """
    if len(head) >= 132 and head[128:132] == b"DICM":
        return True
    if len(head) < 8:
        return False
    return any(struct.unpack(order, head[:2])[0] in (0x0002, 0x0008) for order in ("<H", ">H"))


def is_dicom_file(path: str | os.PathLike) -> bool:
    """True for an existing file that is not NIfTI and starts like DICOM (see :func:`is_dicom_bytes`)."""
    path = Path(path)
    if not path.is_file() or path.name.lower().endswith((".nii", ".nii.gz")):
        return False
    try:
        with open(path, "rb") as f:
            return is_dicom_bytes(f.read(132))
    except OSError:
        return False


def _looks_like_dicom(ds: Dataset) -> bool:
    """A dataset read with force=True is DICOM if it holds a well-formed UID where DICOM puts one, or an
    image: Rows and Columns (with PixelData when the pixels were read). An image without its UIDs is
    then refused by name by the folder scan, never dropped without a word."""
    try:
        for tag in ("SOPClassUID", "SeriesInstanceUID", "SOPInstanceUID"):
            value = ds.get(tag)
            if value is not None and _UID_RE.fullmatch(str(value)):
                return True
        return int(ds.get("Rows", 0) or 0) > 0 and int(ds.get("Columns", 0) or 0) > 0
    except Exception:  # noqa: BLE001 - garbage parsed as elements fails on access in many ways
        return False


def _set_transfer_syntax(ds: Dataset) -> None:
    """A file without file meta: record the encoding it was read with, so its pixels can be decoded."""
    if "TransferSyntaxUID" in ds.file_meta:
        return
    implicit, little = getattr(ds, "original_encoding", (True, True))
    if implicit is None:
        implicit, little = True, True
    ds.file_meta.TransferSyntaxUID = (
        ImplicitVRLittleEndian if implicit else ExplicitVRLittleEndian if little else ExplicitVRBigEndian
    )


def read_header(path: str | Path, *, headers_only: bool = True) -> Dataset | None:
    """Read one file as DICOM, with or without its preamble and file meta.

    None when it is not DICOM; DataError when it claims DICOM but cannot be parsed.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError as e:
        raise DataError(f"{path} cannot be opened ({e.strerror}); check its permissions") from None
    if not is_dicom_bytes(head):
        return None
    preamble = head[128:132] == b"DICM"
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=headers_only, force=not preamble)
    except InvalidDicomError:
        return None
    except Exception as e:  # pydicom raises many kinds on corrupt files
        if not preamble:  # only its first two bytes said DICOM: skip it, but say so
            logger.warning(
                "skipping %s: it starts like DICOM without preamble but cannot be parsed (%s)", path, e
            )
            return None
        raise DataError(
            f"{path} looks like DICOM but cannot be read ({e}); replace or remove the file"
        ) from e
    if not preamble:
        if not _looks_like_dicom(ds):
            logger.debug("skipping %s: parsed without preamble, but holds no DICOM UIDs", path)
            return None
        _set_transfer_syntax(ds)
    return ds


def _read(path: Path, *, headers_only: bool) -> Dataset | None:
    return read_header(path, headers_only=headers_only)


@dataclass
class FolderScan:
    """What a folder holds: its image series, and the files that are not part of any."""

    series: list[SeriesInfo]
    skipped: list[Path] = field(default_factory=list)


def scan_folder(folder: str | Path) -> FolderScan:
    """List the image series under ``folder`` (recursively, headers only), and the files skipped."""
    folder = check_input_path(folder, "DICOM folder")
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder; give the folder that holds the DICOM series")
    found: dict[str, SeriesInfo] = {}
    skipped: list[Path] = []
    # hidden names are skipped: they hold the temporary files of a write in progress
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        ds = _read(path, headers_only=True)
        if ds is None:
            skipped.append(path)
            continue
        # pydicom stops quietly at the end of a truncated file: an image cut before its series UID is
        # reported here; one cut later stays in its series and is reported when that series is read
        sop = ds.file_meta.get("MediaStorageSOPClassUID", "") or ds.get("SOPClassUID", "")
        is_image = "Rows" in ds or "Image Storage" in getattr(sop, "name", "")
        if not sop or len(ds) == 0 or (is_image and "SeriesInstanceUID" not in ds and "Rows" not in ds):
            raise DataError(
                f"{path} has an incomplete DICOM header (truncated or malformed); replace or remove it"
            )
        if not is_image or "SeriesInstanceUID" not in ds:
            log = logger.warning if is_image else logger.debug
            log("skipping %s: %s", path, "no SeriesInstanceUID" if is_image else "not a DICOM image")
            skipped.append(path)
            continue
        uid = str(ds.SeriesInstanceUID)
        info = found.setdefault(
            uid, SeriesInfo(uid, str(ds.get("SeriesDescription", "")), str(ds.get("Modality", "")), 0)
        )
        info.files.append(path)
        info.n_files += 1
        if n_frames(ds) > 1:
            info.multiframe.append(path)
    return FolderScan(list(found.values()), skipped)


def list_series(folder: str | Path) -> list[SeriesInfo]:
    """List the image series under ``folder`` (recursively), reading headers only."""
    return scan_folder(folder).series


def _describe(series: list[SeriesInfo]) -> str:
    return "\n".join(f"  {s.uid}  '{s.description}'  {s.modality}  {s.n_files} file(s)" for s in series)


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


def _opt_float(ds: Dataset, path: Path, tag: str) -> float | None:
    """A numeric tag's value, None when absent or empty; DataError when it is not a finite number."""
    if tag not in ds or ds[tag].value in (None, ""):
        return None
    try:
        value = float(ds[tag].value)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or (tag == "RescaleSlope" and value == 0):
        raise DataError(
            f"{path}: {tag} is {ds[tag].value!r}, which would make every voxel of the slice wrong; "
            "repair or remove the file"
        )
    return value


def _groups(slices: list[Any], key: Any) -> dict[Any, list[Path]]:
    groups: dict[Any, list[Path]] = {}
    for item in slices:
        groups.setdefault(key(item), []).append(item[0])
    return groups


def _show_groups(groups: dict[Any, list[Path]]) -> str:
    return "; ".join(f"{k}: {len(v)} file(s), e.g. {v[0]}" for k, v in list(groups.items())[:4])


def _check_same_across_slices(slices: list[Any], where: str) -> None:
    """Every per-slice tag that changes voxel values or geometry must agree across the series."""
    for tag in _SAME_TAGS:
        groups = _groups(slices, lambda s, t=tag: str(s[1].get(t, "(absent)")))
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
        values = [_opt_float(s[1], s[0], tag) for s in slices]
        absent = [s[0] for s, v in zip(slices, values, strict=True) if v is None]
        if absent and len(absent) < len(slices):
            present = next(s[0] for s, v in zip(slices, values, strict=True) if v is not None)
            raise DataError(
                f"{where}: {absent[0]} has no {tag} but {present} has one ({len(absent)} of {len(slices)} "
                f"slices lack it); its voxel values would be on another scale. Repair or remove those files"
            )
    sops = _groups(slices, lambda s: str(s[1].get("SOPInstanceUID", "")) or str(s[0]))
    dup = next((v for v in sops.values() if len(v) > 1), None)
    if dup:
        raise DataError(
            f"{where}: {dup[0]} and {dup[1]} are the same image (one SOPInstanceUID); remove the copy"
        )


def _check_acquisitions(slices: list[Any], pos: np.ndarray, where: str) -> None:
    """Several acquisitions under one SeriesInstanceUID are refused, never merged into one volume.

    Slices must sit in one acquisition (same echo, inversion time, temporal position). Differing
    AcquisitionNumbers are accepted only when each number holds a contiguous run of positions (CT
    scanners number each rotation of an axial scan); interleaved or overlapping ones are refused.
    Duplicate positions and instance numbers are refused.
    """
    groups = _groups(slices, lambda s: tuple(str(s[1].get(t, "")) for t in _ACQUISITION_TAGS))
    if len(groups) > 1:
        named = {
            ", ".join(f"{t}={v}" for t, v in zip(_ACQUISITION_TAGS, k) if v): v for k, v in groups.items()
        }
        raise DataError(
            f"{where}: holds {len(groups)} acquisitions under one SeriesInstanceUID ({_show_groups(named)}); "
            "medseg will not merge them into one volume. Put each acquisition in its own folder and read it alone"
        )
    numbers = [str(s[1].get("AcquisitionNumber", "")) for s in slices]  # slices are sorted by position
    runs = [n for i, n in enumerate(numbers) if i == 0 or n != numbers[i - 1]]
    if len(set(runs)) != len(runs):
        groups = _groups(slices, lambda s: f"AcquisitionNumber {s[1].get('AcquisitionNumber', '')}")
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
            f"{where}: {slices[g][0]} and {slices[g + 1][0]} share the slice position {pos[g]:.3f} mm; the "
            "folder mixes acquisitions (echoes, phases) or holds a copied slice: split it by series or remove "
            "duplicates"
        )
    numbers_i = _groups(slices, lambda s: str(s[1].get("InstanceNumber", "")))
    dup = next((v for k, v in numbers_i.items() if k and len(v) > 1), None)
    if dup:
        raise DataError(
            f"{where}: {dup[0]} and {dup[1]} have the same InstanceNumber at different positions; the "
            "series mixes two acquisitions or renumbered copies. Split it or remove the odd files"
        )


def read_dicom_series(
    folder: str | Path,
    *,
    series_uid: str | None = None,
    resample: bool = False,
    spacing_tolerance: float = 0.01,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Read one series into (float32 volume indexed (i, j, k), RAS affine 4x4, meta dict).

    ``folder`` may also be one DICOM file: a multi-frame image, or a single slice.
    """
    folder = Path(folder)
    if folder.is_file():
        return _read_one_file(folder, series_uid=series_uid, spacing_tolerance=spacing_tolerance)
    scan = scan_folder(folder)
    series = scan.series
    if not series:
        raise DataError(
            f"{folder} holds no DICOM files ({len(scan.skipped)} other file(s) that pydicom cannot read as DICOM); "
            "point to the folder "
            "that holds the series"
        )
    if series_uid is None and len(series) > 1:
        raise DataError(
            f"{folder} holds {len(series)} DICOM series; choose one with --series UID "
            f"(series_uid=...):\n{_describe(series)}"
        )
    chosen = series[0] if series_uid is None else next((s for s in series if s.uid == series_uid), None)
    if chosen is None:
        raise DataError(
            f"{folder} holds no series with UID {series_uid}; the series there are:\n{_describe(series)}"
        )

    if chosen.multiframe:
        if chosen.n_files == 1:
            return read_multiframe(chosen.files[0], spacing_tolerance=spacing_tolerance)
        example = chosen.multiframe[0]
        raise DataError(
            f"DICOM series {chosen.uid} in {folder}: holds {chosen.n_files} files, {len(chosen.multiframe)} of "
            f"them multi-frame (e.g. {example}); medseg reads either one multi-frame "
            "file or a series of single-frame files. Give the multi-frame file's own path "
            "(medseg data convert FILE.dcm OUT.nii.gz), or remove the odd files"
        )
    return _read_slices(chosen, folder, scan.skipped, resample, spacing_tolerance)


def _read_slices(
    chosen: SeriesInfo, folder: Path, skipped: list[Path], resample: bool, spacing_tolerance: float
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Stack the single-frame files of one series along their slice normal, with every check."""
    first = _read(chosen.files[0], headers_only=True)
    if first is not None and "Rows" in first and "Columns" in first:
        check_memory(
            int(first.Rows) * int(first.Columns) * len(chosen.files),
            max(int(first.get("BitsAllocated", 16) or 16) // 8, 1),
            f"DICOM series {chosen.uid} in {folder}",
        )
    slices = []
    for path in chosen.files:
        ds = _read(path, headers_only=False)
        if ds is None or any(tag not in ds for tag in ("Rows", "Columns", "PixelData")):
            raise DataError(f"{path} holds no image size or pixel data (truncated?); replace or remove it")
        if n_frames(ds) > 1:  # the headers said one frame, the whole file says more: changed meanwhile
            raise DataError(f"{path} is a multi-frame DICOM file inside a single-frame series; remove it")
        iop = _floats(ds, path, "ImageOrientationPatient", 6)
        ipp = _floats(ds, path, "ImagePositionPatient", 3)
        ps = _floats(ds, path, "PixelSpacing", 2)
        slices.append((path, ds, ipp, iop, ps))
    where = f"DICOM series {chosen.uid} in {folder}"
    _check_same_across_slices(slices, where)
    path0, ds0, _, iop0, ps0 = slices[0]
    row_dir, col_dir = iop0[:3] / np.linalg.norm(iop0[:3]), iop0[3:] / np.linalg.norm(iop0[3:])
    normal = np.cross(row_dir, col_dir)
    slices.sort(key=lambda s: float(s[2] @ normal))
    pos = np.array([float(s[2] @ normal) for s in slices])
    ipps = np.array([s[2] for s in slices])
    _check_acquisitions(slices, pos, where)

    planes = []
    for path, ds, *_ in slices:
        try:
            pixels = ds.pixel_array.astype(np.float32)
        except Exception as e:  # decoders raise many kinds
            raise DataError(
                f"{path}: pixel data cannot be decoded ({e}); the file may be truncated, or its "
                "transfer syntax needs an extra decoder (pylibjpeg, gdcm)"
            ) from e
        slope, intercept = _opt_float(ds, path, "RescaleSlope"), _opt_float(ds, path, "RescaleIntercept")
        slope, intercept = 1.0 if slope is None else slope, 0.0 if intercept is None else intercept
        planes.append((pixels * np.float32(slope) + np.float32(intercept)).T)
    volume = np.stack(planes, axis=2).astype(np.float32)

    resampled = False
    if len(slices) == 1:
        spacing = ds0.get("SliceThickness") or ds0.get("SpacingBetweenSlices")
        if not spacing:
            logger.warning("%s: single slice without SliceThickness; slice spacing set to 1.0 mm", path0)
        spacing = float(spacing or 1.0)
        step = normal * spacing
    else:
        gaps = np.diff(pos)
        if np.any(gaps < 1e-3):
            g = int(np.flatnonzero(gaps < 1e-3)[0])
            raise DataError(
                f"{slices[g][0]} and {slices[g + 1][0]} share the slice position {pos[g]:.3f} mm; the "
                "folder mixes acquisitions (echoes, phases): split it by series or remove duplicates"
            )
        try:
            spacing = _check_gaps(gaps, pos, spacing_tolerance, folder)
        except DataError:
            if not resample:
                raise
            if skipped:
                raise DataError(
                    f"{where}: slices are missing or unevenly spaced, and the folder holds {len(skipped)} "
                    f"file(s) that are not slices of this series (e.g. {skipped[0]}); a missing slice may "
                    "be among them, so --resample will not interpolate it. Remove those files or repair them"
                ) from None
            n_out = int(round((pos[-1] - pos[0]) / float(np.median(gaps)))) + 1
            grid = np.linspace(pos[0], pos[-1], n_out)
            hi = np.clip(np.searchsorted(pos, grid, side="right"), 1, len(pos) - 1)
            w = ((grid - pos[hi - 1]) / (pos[hi] - pos[hi - 1])).astype(np.float32)
            volume = volume[:, :, hi - 1] * (1 - w) + volume[:, :, hi] * w
            spacing, resampled = float(grid[1] - grid[0]), True
            logger.warning(
                "%s: uneven slice positions resampled linearly onto %d slices at %.4g mm",
                folder,
                n_out,
                spacing,
            )
        step = (ipps[-1] - ipps[0]) / (volume.shape[2] - 1)
        if np.linalg.norm(step - normal * spacing) < 1e-3:
            step = normal * spacing
        else:
            logger.warning(
                "%s: slice positions drift in-plane (gantry tilt); the affine keeps the shear", folder
            )

    lps = np.eye(4)
    lps[:3, 0], lps[:3, 1], lps[:3, 2] = row_dir * ps0[1], col_dir * ps0[0], step
    lps[:3, 3] = ipps[0]
    affine = _FLIP @ lps
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
    return np.ascontiguousarray(volume, dtype=np.float32), affine, meta


def _read_one_file(
    path: Path, *, series_uid: str | None, spacing_tolerance: float
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """One DICOM file given by its path: a multi-frame image, or a single slice read as a series of one."""
    path = check_input_path(path, "DICOM file")
    ds = read_header(path, headers_only=True)
    if ds is None:
        raise DataError(
            f"{path} is not a DICOM file (pydicom cannot parse it as one, with or without preamble); give a "
            "DICOM image file, the folder of a series, or a NIfTI file (.nii, .nii.gz)"
        )
    if series_uid is not None and str(ds.get("SeriesInstanceUID", "")) != series_uid:
        raise DataError(
            f"{path} belongs to series {ds.get('SeriesInstanceUID', '(none)')}, not {series_uid}; drop "
            "--series or give the folder that holds that series"
        )
    if n_frames(ds) > 1:
        return read_multiframe(path, spacing_tolerance=spacing_tolerance)
    # a single slice, read as a series of one file (its siblings are not looked at)
    info = SeriesInfo(
        str(ds.get("SeriesInstanceUID", "")),
        str(ds.get("SeriesDescription", "")),
        str(ds.get("Modality", "")),
        1,
    )
    info.files.append(path)
    return _read_slices(info, path, [], False, spacing_tolerance)


# ------------------------------------------------------------------------------ multi-frame images

# One file, many frames, geometry per frame in functional groups (DICOM PS3.3 C.7.6.16).
MULTIFRAME_SOP_CLASSES = {
    EnhancedCTImageStorage: "Enhanced CT",
    LegacyConvertedEnhancedCTImageStorage: "Legacy Converted Enhanced CT",
    EnhancedMRImageStorage: "Enhanced MR",
    LegacyConvertedEnhancedMRImageStorage: "Legacy Converted Enhanced MR",
}
_PERPENDICULAR_TOL = 1e-3  # highdicom's: |cos(stacking direction, normal)| must be within this of 1


def n_frames(ds: Dataset) -> int:
    """NumberOfFrames, 1 when absent or empty."""
    try:
        return int(ds.get("NumberOfFrames", 1) or 1)
    except (TypeError, ValueError):
        return 1


def _functional_group(ds: Dataset, frame: int, sequence: str) -> Dataset | None:
    """The first item of ``sequence`` for one frame: the per-frame group wins over the shared group.

    The standard puts each functional group macro in exactly one of the two; a per-frame copy is
    taken first so that a file that (wrongly) has both is read by its per-frame values.
    """
    for groups, index in (("PerFrameFunctionalGroupsSequence", frame), ("SharedFunctionalGroupsSequence", 0)):
        items = ds.get(groups)
        if items is not None and index < len(items):
            seq = items[index].get(sequence)
            if seq:
                return seq[0]
    return None


@dataclass
class FrameGeometry:
    """Per-frame geometry of a multi-frame image, read straight from its functional groups (LPS, mm)."""

    positions: np.ndarray  # (n, 3) ImagePositionPatient of each frame's first pixel
    orientations: np.ndarray  # (n, 6) ImageOrientationPatient: row cosines, then column cosines
    pixel_spacing: np.ndarray  # (n, 2) between rows, between columns
    stack_ids: list[str]
    temporal: list[str]  # TemporalPositionIndex per frame ("" when absent)
    spacing_hint: float | None  # SpacingBetweenSlices of the first frame, when given


def frame_geometry(ds: Dataset, path: Path) -> FrameGeometry:
    """Read PlanePosition, PlaneOrientation, PixelMeasures and FrameContent of every frame."""
    n = n_frames(ds)
    per_frame = ds.get("PerFrameFunctionalGroupsSequence")
    if per_frame is None or len(per_frame) != n:
        raise DataError(
            f"{path}: a multi-frame image of {n} frames needs a PerFrameFunctionalGroupsSequence of {n} "
            f"items, found {0 if per_frame is None else len(per_frame)}; the file is damaged or not an "
            "Enhanced image. Export the series as single frames"
        )

    def value(frame: int, sequence: str, tag: str, count: int) -> np.ndarray:
        item = _functional_group(ds, frame, sequence)
        raw = item[tag].value if item is not None and tag in item else None
        if raw is None or len(raw) != count:
            raise DataError(
                f"{path}: frame {frame + 1} has no {sequence} > {tag} ({count} numbers), neither per frame "
                "nor shared; its place in space cannot be known. Repair or re-export the file"
            )
        return np.array([float(v) for v in raw], dtype=np.float64)

    positions = np.array([value(f, "PlanePositionSequence", "ImagePositionPatient", 3) for f in range(n)])
    orientations = np.array(
        [value(f, "PlaneOrientationSequence", "ImageOrientationPatient", 6) for f in range(n)]
    )
    spacing = np.array([value(f, "PixelMeasuresSequence", "PixelSpacing", 2) for f in range(n)])
    content = [_functional_group(ds, f, "FrameContentSequence") for f in range(n)]
    stack_ids = [str(c.get("StackID", "")) if c is not None else "" for c in content]
    temporal = [str(c.get("TemporalPositionIndex", "")) if c is not None else "" for c in content]
    measures = _functional_group(ds, 0, "PixelMeasuresSequence")
    hint = None if measures is None else _opt_float(measures, path, "SpacingBetweenSlices")
    return FrameGeometry(positions, orientations, spacing, stack_ids, temporal, hint)


def check_frame_geometry(geom: FrameGeometry, path: Path, spacing_tolerance: float = 0.01) -> np.ndarray:
    """Refuse frames that are not one regular stack; return the frame order along the slice normal.

    With row cosines r, column cosines c and normal n = r x c, frame f sits at d_f = n . IPP_f.
    One stack means: one StackID and one temporal position, the same orientation (within 1e-4) and
    pixel spacing (relative 1e-4) in every frame, distinct d_f, IPP_f - IPP_0 parallel to n
    (|cos| within 1e-3 of 1, as highdicom asks: no gantry tilt), and consecutive gaps of the sorted
    d_f equal within ``spacing_tolerance`` of their median (at least 1e-3 mm).
    """
    where = f"{path} (multi-frame, {len(geom.positions)} frames)"
    for name, labels in (
        ("stacks (StackID", geom.stack_ids),
        ("temporal positions (TemporalPositionIndex", geom.temporal),
    ):
        kinds = sorted(set(labels))
        if len(kinds) > 1:
            counts = ", ".join(f"{k or '(none)'}: {labels.count(k)} frames" for k in kinds[:4])
            raise DataError(
                f"{where}: holds {len(kinds)} {name} {counts}); medseg reads one regular stack of "
                "frames. Export each stack as its own file or series"
            )
    iop0, ps0 = geom.orientations[0], geom.pixel_spacing[0]
    for f in range(1, len(geom.positions)):
        if not np.allclose(geom.orientations[f], iop0, atol=1e-4):
            raise DataError(
                f"{where}: frame {f + 1} has ImageOrientationPatient {np.round(geom.orientations[f], 5).tolist()} "
                f"but frame 1 has {np.round(iop0, 5).tolist()}; frames of one volume share one orientation. "
                "The file holds several stacks (a localizer, several planes?): export the one you want alone"
            )
        if not np.allclose(geom.pixel_spacing[f], ps0, rtol=1e-4, atol=1e-6):
            raise DataError(
                f"{where}: frame {f + 1} has PixelSpacing {geom.pixel_spacing[f].tolist()} but frame 1 has "
                f"{ps0.tolist()}; frames of one volume share one pixel spacing. Export one stack alone"
            )
    row, col = iop0[:3] / np.linalg.norm(iop0[:3]), iop0[3:] / np.linalg.norm(iop0[3:])
    normal = np.cross(row, col)
    d = geom.positions @ normal
    order = np.argsort(d, kind="stable")
    if len(order) == 1:
        return order
    gaps = np.diff(d[order])
    if np.any(gaps < 1e-3):
        g = int(np.flatnonzero(gaps < 1e-3)[0])
        raise DataError(
            f"{where}: frames {order[g] + 1} and {order[g + 1] + 1} share the slice position "
            f"{d[order[g]]:.3f} mm; the file holds several stacks (echoes, phases, repeats). Export each "
            "stack as its own file"
        )
    spans = geom.positions[order[1:]] - geom.positions[order[0]]
    cos = np.abs(spans @ normal) / np.linalg.norm(spans, axis=1)
    if np.any(cos < 1 - _PERPENDICULAR_TOL):
        f = int(order[1:][np.argmin(cos)])
        tilt = float(np.degrees(np.arccos(np.clip(cos.min(), -1, 1))))
        raise DataError(
            f"{where}: frame {f + 1} lies {tilt:.2f} degrees off the slice normal of frame {order[0] + 1} "
            "(gantry tilt, or frames of different stacks); medseg reads only frames stacked along their "
            "normal. Export the series resampled onto an untilted grid"
        )
    median = float(np.median(gaps))
    if np.any(np.abs(gaps - median) > max(spacing_tolerance * median, 1e-3)):
        raise DataError(
            f"{where}: uneven slice spacing, gaps between consecutive frames {np.round(gaps, 4).tolist()} mm "
            f"(tolerance {spacing_tolerance:.0%}); medseg does not interpolate multi-frame files. Export a "
            "regularly spaced stack, or the frames as a single-frame series (then --resample applies)"
        )
    if geom.spacing_hint is not None and not math.isclose(
        abs(geom.spacing_hint), median, rel_tol=spacing_tolerance, abs_tol=1e-3
    ):
        raise DataError(
            f"{where}: SpacingBetweenSlices is {geom.spacing_hint:g} mm but the frames lie {median:.4g} mm "
            "apart along the slice normal; the header contradicts itself. Repair or re-export the file"
        )
    return order


def read_multiframe(
    path: str | Path, ds: Dataset | None = None, *, spacing_tolerance: float = 0.01
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Read an Enhanced or Legacy Converted Enhanced CT/MR image into (volume (i, j, k), RAS affine, meta).

    The frames are checked with :func:`check_frame_geometry` (pydicom, for messages that name the
    frame), then stacked by highdicom's ``Image.get_volume``, which applies each frame's
    PixelValueTransformationSequence (rescale slope and intercept) and returns the voxels as
    (slice, row, column) with an LPS affine ``A``. medseg's axes are (column, row, slice), so the
    volume is transposed and ``A``'s first three columns reversed; if the slice axis then points
    against the normal n = r x c, k is reversed (origin moved to the last slice, step negated), so
    that k runs along n as it does for single-frame series. Finally ``RAS = diag(-1, -1, 1, 1) @ LPS``.
    """
    import highdicom as hd

    path = Path(path)
    header = ds if ds is not None else read_header(path, headers_only=True)
    if header is None:
        raise DataError(f"{path} is not a DICOM file; give a DICOM image or the folder of a series")
    sop = str(header.get("SOPClassUID", "") or header.file_meta.get("MediaStorageSOPClassUID", ""))
    if sop not in MULTIFRAME_SOP_CLASSES:
        name = getattr(pydicom.uid.UID(sop), "name", sop) if sop else "no SOPClassUID"
        raise DataError(
            f"{path} is a multi-frame DICOM file of {name}, which medseg does not read; it reads "
            f"{', '.join(MULTIFRAME_SOP_CLASSES.values())} images and single-frame series"
        )
    if "Rows" not in header or "Columns" not in header:
        raise DataError(f"{path} holds no image size (Rows, Columns); the file is damaged, replace it")
    n = n_frames(header)
    check_memory(
        int(header.Rows) * int(header.Columns) * n,
        max(int(header.get("BitsAllocated", 16) or 16) // 8, 1),
        f"multi-frame DICOM file {path}",
    )
    geom = frame_geometry(header, path)
    order = check_frame_geometry(geom, path, spacing_tolerance)
    if ds is None or "PixelData" not in ds:
        ds = read_header(path, headers_only=False)
    if ds is None or "PixelData" not in ds:
        raise DataError(f"{path} holds no pixel data (truncated?); replace it")
    try:
        image = hd.Image.from_dataset(ds, copy=False)
        vol = image.get_volume(
            dtype=np.float32,
            apply_real_world_transform=False,  # stored values with the modality rescale, like single frames
            apply_voi_transform=False,
            apply_presentation_lut=False,
            rtol=spacing_tolerance,
        )
    except DataError:
        raise
    except Exception as e:  # highdicom and the pixel decoders raise many kinds
        raise DataError(
            f"{path}: the multi-frame image cannot be read as one volume ({type(e).__name__}: {e}); "
            "if its transfer syntax is compressed an extra decoder (pylibjpeg, gdcm) may be needed"
        ) from e
    array = np.asarray(vol.array)
    if array.ndim != 3 or array.shape[0] != n:
        raise DataError(
            f"{path}: highdicom stacked {n} frames into a volume of shape {array.shape}; expected {n} "
            "slices. The frames do not form one volume: export one stack alone"
        )
    volume = np.ascontiguousarray(array.transpose(2, 1, 0), dtype=np.float32)
    lps = np.eye(4)
    lps[:3, :3] = np.asarray(vol.affine, dtype=np.float64)[:3, 2::-1]
    lps[:3, 3] = np.asarray(vol.affine, dtype=np.float64)[:3, 3]
    iop0 = geom.orientations[0]
    normal = np.cross(iop0[:3], iop0[3:])
    if n > 1 and float(lps[:3, 2] @ normal) < 0:
        volume = np.ascontiguousarray(volume[:, :, ::-1])
        lps[:3, 3] = lps[:3, 3] + (n - 1) * lps[:3, 2]
        lps[:3, 2] = -lps[:3, 2]
    if n == 1:  # a single frame: highdicom takes SpacingBetweenSlices or 1 mm; use the thickness first
        measures = _functional_group(header, 0, "PixelMeasuresSequence")
        thickness = None if measures is None else _opt_float(measures, path, "SliceThickness")
        if thickness:
            lps[:3, 2] = normal / np.linalg.norm(normal) * thickness
    first = geom.positions[order[0]]
    if np.linalg.norm(lps[:3, 3] - first) > 1e-3:
        raise DataError(
            f"{path}: highdicom placed the first slice at {lps[:3, 3].round(4).tolist()} but the frame "
            f"nearest along the normal is at {first.round(4).tolist()}; refusing an ambiguous geometry"
        )
    affine = _FLIP @ lps
    spacing = [float(v) for v in np.linalg.norm(lps[:3, :3], axis=0)]
    meta: dict[str, Any] = {
        "spacing": spacing,
        "modality": str(header.get("Modality", "")),
        "series_uid": str(header.get("SeriesInstanceUID", "")),
        "series_description": str(header.get("SeriesDescription", "")),
        "n_slices": int(volume.shape[2]),
        "n_files": 1,
        "n_frames": n,
        "sop_class": MULTIFRAME_SOP_CLASSES[sop],
        "resampled": False,
        "filename_or_obj": str(path),
    }
    logger.info("read %s: %s, %d frames, spacing %s mm", path, meta["sop_class"], n, spacing)
    return volume, affine, meta


@dataclass
class _SeriesRead:
    """What DicomSeriesReader.read found: the read series, or the DataError to raise in get_data."""

    folder: str
    volume: np.ndarray | None = None
    affine: np.ndarray | None = None
    meta: dict[str, Any] | None = None
    error: DataError | None = None


class DicomSeriesReader(ImageReader):
    """MONAI reader for a DICOM series folder, with the checks of :func:`read_dicom_series`.

    ``read`` keeps a DataError and ``get_data`` raises it: MONAI's LoadImage swallows errors from
    ``read`` and falls back to its own readers, which would average uneven slice spacing silently.
    """

    def __init__(
        self, series_uid: str | None = None, resample: bool = False, spacing_tolerance: float = 0.01
    ):
        super().__init__()
        self.series_uid, self.resample, self.spacing_tolerance = series_uid, resample, spacing_tolerance

    def verify_suffix(self, filename: Sequence[str | os.PathLike] | str | os.PathLike) -> bool:
        """True for one existing directory or DICOM file (or a list/tuple holding exactly one)."""
        if isinstance(filename, list | tuple):
            if len(filename) != 1:
                return False
            filename = filename[0]
        return Path(filename).is_dir() or is_dicom_file(filename)

    def read(self, data: Sequence[str | os.PathLike] | str | os.PathLike, **kwargs: Any) -> _SeriesRead:
        """Read the series in one folder; kwargs may override series_uid, resample, spacing_tolerance."""
        if isinstance(data, list | tuple):
            if len(data) != 1:
                raise DataError(f"DicomSeriesReader reads one folder at a time, got {list(data)}")
            data = data[0]
        result = _SeriesRead(str(data))
        try:
            result.volume, result.affine, result.meta = read_dicom_series(
                data,
                series_uid=kwargs.get("series_uid", self.series_uid),
                resample=kwargs.get("resample", self.resample),
                spacing_tolerance=kwargs.get("spacing_tolerance", self.spacing_tolerance),
            )
        except DataError as e:
            result.error = e
        return result

    def get_data(self, img: _SeriesRead) -> tuple[np.ndarray, dict]:
        """Return the (i, j, k) volume and a meta dict with MONAI's keys (affine in RAS, no channel)."""
        if img.error is not None:
            raise img.error
        assert img.volume is not None and img.affine is not None and img.meta is not None
        meta = dict(img.meta)
        meta[MetaKeys.AFFINE] = img.affine.copy()
        meta[MetaKeys.ORIGINAL_AFFINE] = img.affine.copy()
        meta[MetaKeys.SPATIAL_SHAPE] = np.asarray(img.volume.shape)
        meta[MetaKeys.SPACE] = SpaceKeys.RAS
        meta[MetaKeys.ORIGINAL_CHANNEL_DIM] = float("nan")
        meta["filename_or_obj"] = img.folder
        return img.volume, meta


def dicom_to_nifti(
    dicom_dir: str | Path, out_path: str | Path, *, series_uid: str | None = None, resample: bool = False
) -> Path:
    """Convert one DICOM series to NIfTI (sform and qform = the RAS affine, code 1), written atomically."""
    out_path = prepare_output_file(out_path, [dicom_dir], (".nii", ".nii.gz"), "NIfTI output", create=False)
    volume, affine, _ = read_dicom_series(dicom_dir, series_uid=series_uid, resample=resample)
    save_nifti(volume, affine, out_path)
    logger.info("converted DICOM series in %s to %s", dicom_dir, out_path)
    return out_path
