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


def dcm2niix(source: Path, out_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Convert a DICOM folder with dcm2niix (an independent C++ implementation); return (voxels, RAS affine).

    dcm2niix writes NIfTI, whose sform is RAS+ (x grows toward the patient's right, y anterior, z
    superior; DICOM's LPS+ is diag(-1, -1, 1) of it), and may flip or permute axes on its own: compare
    positions, never raw indices. The voxels have the NIfTI scaling (DICOM rescale slope/intercept) applied.
    """
    import shutil
    import subprocess

    import nibabel as nib

    exe = shutil.which("dcm2niix")
    assert exe, "dcm2niix is missing: run `make dicom-deps` (Debian package dcm2niix)"
    out_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [exe, "-z", "n", "-b", "n", "-f", "converted", "-o", str(out_dir), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    written = sorted(out_dir.glob("*.nii"))
    assert done.returncode == 0 and len(written) == 1, f"dcm2niix gave {written}:\n{done.stdout}{done.stderr}"
    img = nib.load(written[0])
    return np.asarray(img.get_fdata(), dtype=np.float64), np.asarray(img.affine, dtype=np.float64)


def corner_voxel_error(
    volume: np.ndarray, affine: np.ndarray, ref_volume: np.ndarray, ref_affine: np.ndarray
) -> float:
    """Largest distance (mm) between where two readers put the same corner voxel, both affines RAS.

    Which voxel of ``ref_volume`` is which voxel of ``volume`` is found from the voxel values alone: the
    one axis permutation and flip (of 48) that makes the reference array equal to ``volume``. Each of the
    8 corner voxels c of ``volume`` is then at ``affine @ c`` by the first reader and at
    ``ref_affine @ c'`` by the reference, c' being the same voxel's index in the reference.
    """
    from itertools import permutations, product

    volume = np.asarray(volume, dtype=np.float64)
    scale = max(float(np.abs(volume).max()), 1.0)
    matches = []
    for perm in permutations(range(3)):
        moved = np.transpose(ref_volume, perm)  # axis n of moved is axis perm[n] of the reference
        if moved.shape != volume.shape:
            continue
        for flips in product((False, True), repeat=3):
            flipped = np.flip(moved, [n for n in range(3) if flips[n]]) if any(flips) else moved
            if np.allclose(flipped, volume, rtol=1e-5, atol=1e-4 * scale):
                matches.append((perm, flips))
    assert len(matches) == 1, f"the two volumes match under {len(matches)} axis permutations/flips, need 1"
    perm, flips = matches[0]
    error = 0.0
    for corner in product(*[(0, n - 1) for n in volume.shape]):
        ref_index = [0, 0, 0]
        for n in range(3):
            size = ref_volume.shape[perm[n]]
            ref_index[perm[n]] = size - 1 - corner[n] if flips[n] else corner[n]
        here = affine @ [*corner, 1.0]
        there = ref_affine @ [*ref_index, 1.0]
        error = max(error, float(np.linalg.norm(here[:3] - there[:3])))
    return error
