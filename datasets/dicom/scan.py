"""Finding the DICOM image series in a folder, reading headers only."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from medseg.datasets.checks import check_input_path
from medseg.datasets.dicom.header import n_frames, read_header
from medseg.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class SeriesInfo:
    """One image series found in a folder."""

    uid: str
    description: str
    modality: str
    n_files: int
    files: list[Path] = field(default_factory=list)
    multiframe: list[Path] = field(default_factory=list)  # files holding more than one frame


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
        ds = read_header(path, headers_only=True)
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


def describe_series(series: list[SeriesInfo]) -> str:
    """One line per series: UID, description, modality and file count, for messages that ask to choose."""
    return "\n".join(f"  {s.uid}  '{s.description}'  {s.modality}  {s.n_files} file(s)" for s in series)
