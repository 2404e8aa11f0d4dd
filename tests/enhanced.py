"""Multi-frame DICOM files made for tests: highdicom's legacy converter applied to a single-frame series."""

from __future__ import annotations

import random
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
from pydicom.uid import MRImageStorage


def _as_mr(ds: pydicom.Dataset) -> pydicom.Dataset:
    """A written CT slice turned into an MR Image Storage slice (the MR converter takes only those)."""
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = MRImageStorage
    ds.Modality = "MR"
    ds.ScanningSequence, ds.SequenceVariant, ds.ScanOptions, ds.MRAcquisitionType = "GR", "SP", "", "3D"
    ds.RepetitionTime, ds.EchoTime, ds.EchoTrainLength, ds.MagneticFieldStrength = 20.0, 4.0, 1, 3.0
    ds.ImageType = ["ORIGINAL", "PRIMARY", "OTHER"]
    return ds


def to_multiframe(series: Path, out: Path, *, mr: bool = False, seed: int = 0) -> Path:
    """Convert a single-frame series into one Legacy Converted Enhanced file, frames in shuffled order.

    highdicom's converter stores the frames sorted along the normal; scanners need not (acquisition
    order, interleaved slices), so the frames and their per-frame functional groups are then permuted
    together: the file stays valid and only a reader that sorts by per-frame position gets it right.
    """
    datasets = [pydicom.dcmread(p) for p in sorted(series.iterdir())]
    if mr:
        datasets = [_as_mr(ds) for ds in datasets]
    cls = hd.legacy.LegacyConvertedEnhancedMRImage if mr else hd.legacy.LegacyConvertedEnhancedCTImage
    image = cls(
        datasets,
        series_instance_uid=hd.UID(),
        series_number=99,
        sop_instance_uid=hd.UID(),
        instance_number=1,
    )
    out.mkdir(parents=True)
    path = out / "enhanced.dcm"
    image.save_as(path)
    ds = pydicom.dcmread(path)
    assert not ds.file_meta.TransferSyntaxUID.is_compressed
    frames = ds.pixel_array
    order = list(range(len(frames)))
    while order == sorted(order) or order == sorted(order, reverse=True):
        random.Random(seed).shuffle(order)
        seed += 1
    ds.PerFrameFunctionalGroupsSequence = [ds.PerFrameFunctionalGroupsSequence[i] for i in order]
    ds.PixelData = np.ascontiguousarray(frames[order]).tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path
