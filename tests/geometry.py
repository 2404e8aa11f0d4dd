"""Test helpers that compute geometry straight from file headers, independently of medseg's readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
from scipy.spatial.transform import Rotation


def dicom_series_geometry(folder: Path) -> tuple[np.ndarray, tuple[int, int, int]]:
    """RAS affine and (columns, rows, slices) shape of a DICOM series, from IPP/IOP/PixelSpacing alone."""
    headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in folder.iterdir() if p.suffix == ".dcm"]
    iop = np.asarray(headers[0].ImageOrientationPatient, float)
    row, col = iop[:3], iop[3:]
    normal = np.cross(row, col)
    headers.sort(key=lambda h: float(np.dot(normal, np.asarray(h.ImagePositionPatient, float))))
    between_rows, between_cols = (float(v) for v in headers[0].PixelSpacing)
    first = np.asarray(headers[0].ImagePositionPatient, float)
    second = np.asarray(headers[1].ImagePositionPatient, float)
    lps = np.eye(4)
    lps[:3, 0], lps[:3, 1], lps[:3, 2], lps[:3, 3] = (
        row * between_cols,
        col * between_rows,
        second - first,
        first,
    )
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps, (
        int(headers[0].Columns),
        int(headers[0].Rows),
        len(headers),
    )


def oblique(affine: np.ndarray, degrees: tuple[float, float, float] = (12.0, -20.0, 7.0)) -> np.ndarray:
    """The same voxel grid turned about the world origin by three Euler angles (a non-axis-aligned scan)."""
    turn = np.eye(4)
    turn[:3, :3] = Rotation.from_euler("xyz", degrees, degrees=True).as_matrix()
    return turn @ affine
