"""Enhanced and Legacy Converted Enhanced CT/MR images: one file, every frame, geometry per frame.

Each frame's place in space is in the file's functional groups (DICOM PS3.3 C.7.6.16). The frames
are checked to form one regular stack, then stacked by highdicom so that k runs along the slice
normal n = r x c, as for single-frame series.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.uid import (
    EnhancedCTImageStorage,
    EnhancedMRImageStorage,
    LegacyConvertedEnhancedCTImageStorage,
    LegacyConvertedEnhancedMRImageStorage,
)

from medseg.datasets.checks import check_memory
from medseg.datasets.dicom.header import RAS_LPS_FLIP, n_frames, optional_float, read_header
from medseg.errors import DataError

logger = logging.getLogger(__name__)

# One file, many frames, geometry per frame in functional groups (DICOM PS3.3 C.7.6.16).
MULTIFRAME_SOP_CLASSES = {
    EnhancedCTImageStorage: "Enhanced CT",
    LegacyConvertedEnhancedCTImageStorage: "Legacy Converted Enhanced CT",
    EnhancedMRImageStorage: "Enhanced MR",
    LegacyConvertedEnhancedMRImageStorage: "Legacy Converted Enhanced MR",
}
_PERPENDICULAR_TOL = 1e-3  # highdicom's: |cos(stacking direction, normal)| must be within this of 1


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
    hint = None if measures is None else optional_float(measures, path, "SpacingBetweenSlices")
    return FrameGeometry(positions, orientations, spacing, stack_ids, temporal, hint)


def _check_frames_alike(geom: FrameGeometry, where: str) -> None:
    """Refuse frames of several stacks or temporal positions, or with differing orientation or pixel spacing."""
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


def check_frame_geometry(geom: FrameGeometry, path: Path, spacing_tolerance: float = 0.01) -> np.ndarray:
    """Refuse frames that are not one regular stack; return the frame order along the slice normal.

    With row cosines r, column cosines c and normal n = r x c, frame f sits at d_f = n . IPP_f.
    One stack means: one StackID and one temporal position, the same orientation (within 1e-4) and
    pixel spacing (relative 1e-4) in every frame, distinct d_f, IPP_f - IPP_0 parallel to n
    (|cos| within 1e-3 of 1, as highdicom asks: no gantry tilt), and consecutive gaps of the sorted
    d_f equal within ``spacing_tolerance`` of their median (at least 1e-3 mm).
    """
    where = f"{path} (multi-frame, {len(geom.positions)} frames)"
    _check_frames_alike(geom, where)
    iop0 = geom.orientations[0]
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


def _check_multiframe_header(header: Dataset, path: Path) -> str:
    """Refuse a file medseg cannot read as one multi-frame volume, or one too large for memory; return its SOP class UID."""
    sop = str(header.get("SOPClassUID", "") or header.file_meta.get("MediaStorageSOPClassUID", ""))
    if sop not in MULTIFRAME_SOP_CLASSES:
        name = getattr(pydicom.uid.UID(sop), "name", sop) if sop else "no SOPClassUID"
        raise DataError(
            f"{path} is a multi-frame DICOM file of {name}, which medseg does not read; it reads "
            f"{', '.join(MULTIFRAME_SOP_CLASSES.values())} images and single-frame series"
        )
    if "Rows" not in header or "Columns" not in header:
        raise DataError(f"{path} holds no image size (Rows, Columns); the file is damaged, replace it")
    check_memory(
        int(header.Rows) * int(header.Columns) * n_frames(header),
        max(int(header.get("BitsAllocated", 16) or 16) // 8, 1),
        f"multi-frame DICOM file {path}",
    )
    return sop


def _stack_frames(ds: Dataset, path: Path, n: int, spacing_tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """highdicom's volume of the frames: (array indexed (slice, row, column), LPS affine 4x4).

    The stored values get the modality rescale of each frame (PixelValueTransformationSequence),
    as single-frame slices do; no real-world, VOI or presentation transform.
    """
    import highdicom as hd

    try:
        image = hd.Image.from_dataset(ds, copy=False)
        vol = image.get_volume(
            dtype=np.float32,
            apply_real_world_transform=False,
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
    return array, np.asarray(vol.affine, dtype=np.float64)


def _along_normal(
    array: np.ndarray, hd_affine: np.ndarray, geom: FrameGeometry, header: Dataset, path: Path
) -> tuple[np.ndarray, np.ndarray]:
    """highdicom's (slice, row, column) volume as medseg's (column, row, slice) with k along n; (volume, LPS affine).

    The array is transposed and the affine's first three columns reversed. If the slice axis then
    points against n = r x c, k is reversed: origin += (N - 1) * step, step = -step. A single frame
    takes SliceThickness as its step along n when given (highdicom uses SpacingBetweenSlices or 1 mm).
    """
    n = array.shape[0]
    volume = np.ascontiguousarray(array.transpose(2, 1, 0), dtype=np.float32)
    lps = np.eye(4)
    lps[:3, :3] = hd_affine[:3, 2::-1]
    lps[:3, 3] = hd_affine[:3, 3]
    iop0 = geom.orientations[0]
    normal = np.cross(iop0[:3], iop0[3:])
    if n > 1 and float(lps[:3, 2] @ normal) < 0:
        volume = np.ascontiguousarray(volume[:, :, ::-1])
        lps[:3, 3] = lps[:3, 3] + (n - 1) * lps[:3, 2]
        lps[:3, 2] = -lps[:3, 2]
    if n == 1:
        measures = _functional_group(header, 0, "PixelMeasuresSequence")
        thickness = None if measures is None else optional_float(measures, path, "SliceThickness")
        if thickness:
            lps[:3, 2] = normal / np.linalg.norm(normal) * thickness
    return volume, lps


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
    path = Path(path)
    header = ds if ds is not None else read_header(path, headers_only=True)
    if header is None:
        raise DataError(f"{path} is not a DICOM file; give a DICOM image or the folder of a series")
    sop = _check_multiframe_header(header, path)
    n = n_frames(header)
    geom = frame_geometry(header, path)
    order = check_frame_geometry(geom, path, spacing_tolerance)
    if ds is None or "PixelData" not in ds:
        ds = read_header(path, headers_only=False)
    if ds is None or "PixelData" not in ds:
        raise DataError(f"{path} holds no pixel data (truncated?); replace it")
    array, hd_affine = _stack_frames(ds, path, n, spacing_tolerance)
    volume, lps = _along_normal(array, hd_affine, geom, header, path)
    first = geom.positions[order[0]]
    if np.linalg.norm(lps[:3, 3] - first) > 1e-3:
        raise DataError(
            f"{path}: highdicom placed the first slice at {lps[:3, 3].round(4).tolist()} but the frame "
            f"nearest along the normal is at {first.round(4).tolist()}; refusing an ambiguous geometry"
        )
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
    return volume, RAS_LPS_FLIP @ lps, meta
