"""Writing a volume as a DICOM CT Image Storage series, one file per slice.

Slice k of a volume is one DICOM image whose column index is i and row index is j:
``pixel_array = volume[:, :, k].T``. The affine is RAS; DICOM stores LPS (see
:data:`~medseg.datasets.dicom.header.RAS_LPS_FLIP`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid
from pydicom.valuerep import format_number_as_ds

from medseg.datasets.checks import prepare_output_dir
from medseg.datasets.dicom.header import RAS_LPS_FLIP
from medseg.errors import DataError

logger = logging.getLogger(__name__)

_INT16_MIN, _INT16_MAX = -32768, 32767


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


def _checked_lps_affine(
    volume: np.ndarray, affine: np.ndarray, out_dir: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[float, float, float]]:
    """Refuse what DICOM cannot store; return (LPS affine, row cosines, column cosines, spacings i, j, k).

    DICOM slices are planes of orthogonal rows and columns stacked along an axis outside the plane:
    the i and j columns of the affine must be perpendicular, and k must not lie in their plane.
    """
    if volume.ndim != 3 or min(volume.shape) < 1:
        raise DataError(f"write_dicom_series needs a 3D volume, got shape {volume.shape} for {out_dir}")
    if affine.shape != (4, 4) or not np.all(np.isfinite(affine)):
        raise DataError(f"write_dicom_series needs a finite 4x4 affine for {out_dir}, got {affine.tolist()}")
    if not np.all(np.isfinite(volume)):
        raise DataError(f"the volume for {out_dir} holds NaN or infinite values; replace them before writing")
    lps = RAS_LPS_FLIP @ affine
    sp_i, sp_j, sp_k = (float(np.linalg.norm(lps[:3, n])) for n in range(3))
    if min(sp_i, sp_j, sp_k) <= 0:
        raise DataError(f"the affine for {out_dir} has a zero-length axis: {affine.tolist()}")
    row_dir, col_dir = lps[:3, 0] / sp_i, lps[:3, 1] / sp_j
    if abs(float(row_dir @ col_dir)) > 1e-4:
        raise DataError(f"the affine for {out_dir} shears the i/j plane, which DICOM cannot store")
    if abs(float(np.cross(row_dir, col_dir) @ lps[:3, 2])) < 1e-6 * sp_k:
        raise DataError(f"the affine for {out_dir} puts the k axis inside the slice plane")
    return lps, row_dir, col_dir, (sp_i, sp_j, sp_k)


def _write_slices(
    ds: Dataset, stored: np.ndarray, lps: np.ndarray, out_dir: Path
) -> tuple[list[Path], list[Path]]:
    """Save slice k of ``stored`` under a hidden temporary name; return (temporary, final) paths.

    One header is updated per slice. If any save fails, the temporary files written so far are removed.
    """
    tmp_paths: list[Path] = []
    final_paths: list[Path] = []
    try:
        for k in range(stored.shape[2]):
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
    return tmp_paths, final_paths


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
    lps, row_dir, col_dir, (sp_i, sp_j, _) = _checked_lps_affine(volume, affine, out_dir)

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

    tmp_paths, final_paths = _write_slices(ds, stored, lps, out_dir)
    for p in old:
        if p not in final_paths:
            p.unlink()
    for tmp, final in zip(tmp_paths, final_paths, strict=True):
        os.replace(tmp, final)
    logger.info("wrote %d DICOM slices (series %s) to %s", len(final_paths), series_uid, out_dir)
    return final_paths
