"""One DICOM file: telling it from other files, parsing it, and reading its numeric tags.

Volumes are indexed (i, j, k) with a 4x4 voxel-to-world affine in RAS (the NIfTI/MONAI convention).
DICOM stores LPS, so ``LPS = diag(-1, -1, 1) @ RAS`` (:data:`RAS_LPS_FLIP`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import struct
from pathlib import Path

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError
from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

from medseg.errors import DataError

logger = logging.getLogger(__name__)

RAS_LPS_FLIP = np.diag([-1.0, -1.0, 1.0, 1.0])  # RAS <-> LPS (its own inverse)
_UID_RE = re.compile(r"[0-9]+(\.[0-9]+)+")


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


def n_frames(ds: Dataset) -> int:
    """NumberOfFrames, 1 when absent or empty."""
    try:
        return int(ds.get("NumberOfFrames", 1) or 1)
    except (TypeError, ValueError):
        return 1


def optional_float(ds: Dataset, path: Path, tag: str) -> float | None:
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
