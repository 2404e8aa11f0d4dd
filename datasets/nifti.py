"""NIfTI writing that never leaves a half-written file behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from medseg.datasets.checks import prepare_output_file


def nifti_codes(image: Any) -> tuple[int, int]:
    """The (sform, qform) codes of the NIfTI file ``image`` (a MetaTensor, or anything with a
    ``meta`` dict) was read from, for a mask written on its grid; (1, 1) (scanner coordinates) for
    a DICOM series or a file that set neither."""
    try:
        codes = (int(image.meta["sform_code"]), int(image.meta["qform_code"]))
    except (AttributeError, KeyError, TypeError, ValueError):
        return 1, 1
    return codes if any(codes) and all(0 <= c <= 4 for c in codes) else (1, 1)


def save_nifti(
    array: np.ndarray, affine: np.ndarray, path: str | Path, codes: tuple[int, int] = (1, 1)
) -> Path:
    """Write ``array`` with the RAS ``affine`` as sform and qform (with ``codes``: (sform, qform),
    scanner by default; :func:`nifti_codes` keeps an input's) to ``path`` atomically.

    The data goes to a hidden temporary file beside ``path`` (same suffix, so nibabel compresses
    ``.nii.gz``) and is renamed over ``path`` only when complete.
    """
    path = prepare_output_file(path, what="NIfTI output")  # an existing folder or a file as parent: DataError
    suffix = ".nii.gz" if path.name.endswith(".nii.gz") else path.suffix
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name[: -len(suffix)]}{suffix}")
    img = nib.Nifti1Image(np.asarray(array), np.asarray(affine, dtype=np.float64))
    img.set_sform(img.affine, code=codes[0])
    img.set_qform(img.affine, code=codes[1])
    img.header.set_xyzt_units("mm")
    try:
        nib.save(img, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
