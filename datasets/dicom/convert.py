"""DICOM to NIfTI conversion of one series."""

from __future__ import annotations

import logging
from pathlib import Path

from medseg.datasets.checks import prepare_output_file
from medseg.datasets.dicom.reader import read_dicom_series
from medseg.datasets.nifti import save_nifti

logger = logging.getLogger(__name__)


def dicom_to_nifti(
    dicom_dir: str | Path, out_path: str | Path, *, series_uid: str | None = None, resample: bool = False
) -> Path:
    """Convert one DICOM series to NIfTI (sform and qform = the RAS affine, code 1), written atomically."""
    out_path = prepare_output_file(out_path, [dicom_dir], (".nii", ".nii.gz"), "NIfTI output", create=False)
    volume, affine, _ = read_dicom_series(dicom_dir, series_uid=series_uid, resample=resample)
    save_nifti(volume, affine, out_path)
    logger.info("converted DICOM series in %s to %s", dicom_dir, out_path)
    return out_path
