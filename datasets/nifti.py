"""NIfTI writing that never leaves a half-written file behind."""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np

from medseg.datasets.checks import prepare_output_file


def save_nifti(array: np.ndarray, affine: np.ndarray, path: str | Path) -> Path:
    """Write ``array`` with the RAS ``affine`` (sform and qform, code 1) to ``path`` atomically.

    The data goes to a hidden temporary file beside ``path`` (same suffix, so nibabel compresses
    ``.nii.gz``) and is renamed over ``path`` only when complete.
    """
    path = prepare_output_file(path, what="NIfTI output")  # an existing folder or a file as parent: DataError
    suffix = ".nii.gz" if path.name.endswith(".nii.gz") else path.suffix
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name[: -len(suffix)]}{suffix}")
    img = nib.Nifti1Image(np.asarray(array), np.asarray(affine, dtype=np.float64))
    img.set_sform(img.affine, code=1)
    img.set_qform(img.affine, code=1)
    img.header.set_xyzt_units("mm")
    try:
        nib.save(img, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
