"""Reading DICOM into a volume: the public entry point for a folder or one file, and MONAI's reader.

A folder is scanned for its series (:mod:`~medseg.datasets.dicom.scan`); one series is read either
as single-frame slices (:mod:`~medseg.datasets.dicom.series`) or as one Enhanced multi-frame file
(:mod:`~medseg.datasets.dicom.multiframe`). Every path returns a float32 volume indexed (i, j, k),
its 4x4 RAS affine, and a meta dict.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from monai.data import ImageReader
from monai.utils import MetaKeys, SpaceKeys

from medseg.datasets.checks import check_input_path
from medseg.datasets.dicom.header import is_dicom_file, n_frames, read_header
from medseg.datasets.dicom.multiframe import read_multiframe
from medseg.datasets.dicom.scan import SeriesInfo, describe_series, scan_folder
from medseg.datasets.dicom.series import read_slices
from medseg.errors import DataError


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
            f"(series_uid=...):\n{describe_series(series)}"
        )
    chosen = series[0] if series_uid is None else next((s for s in series if s.uid == series_uid), None)
    if chosen is None:
        raise DataError(
            f"{folder} holds no series with UID {series_uid}; the series there are:\n{describe_series(series)}"
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
    return read_slices(chosen, folder, scan.skipped, resample, spacing_tolerance)


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
    return read_slices(info, path, [], False, spacing_tolerance)


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
