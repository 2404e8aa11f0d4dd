"""Input that scanners really write reads correctly; the viewer shares the checks; geometry round-trips.

The refusals are in test_fuzz_input.py; these are the cases that must give the correct result.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.spatial.transform import Rotation

from medseg.cli.main import main
from medseg.datasets import checks
from medseg.datasets.dicom.reader import read_dicom_series
from medseg.datasets.dicom.write import write_dicom_series
from medseg.datasets.nifti import save_nifti
from medseg.errors import DataError
from tests.datasets.test_fuzz_input import AFFINE, _edit, _nifti, _no_preamble, _raw_header_nifti, _set, _vol
from tests.geometry import dicom_series_geometry


def _series(folder: Path, n: int = 6) -> tuple[list[Path], np.ndarray]:
    volume = _vol((10, 8, n)).astype(np.float32)
    return write_dicom_series(volume, AFFINE, folder), volume


@pytest.mark.parametrize("which", ["all", "first", "last", "middle"])
def test_files_without_preamble_are_read(tmp_path: Path, which: str) -> None:
    files, volume = _series(tmp_path / "s")
    chosen = {"all": files, "first": files[:1], "last": files[-1:], "middle": files[2:3]}[which]
    for f in chosen:
        _no_preamble(f)
        assert pydicom.dcmread(f, force=True).preamble is None
    got, affine, meta = read_dicom_series(tmp_path / "s", resample=True)
    assert meta["n_slices"] == 6 and not meta["resampled"]
    np.testing.assert_allclose(affine, AFFINE, atol=1e-6)
    np.testing.assert_array_equal(got, volume)


def test_slope_and_intercept_applied_per_slice(tmp_path: Path) -> None:
    files, volume = _series(tmp_path / "s")
    stored = pydicom.dcmread(files[1]).pixel_array.astype(np.float32)
    _edit(files[1], _set(RescaleSlope="2", RescaleIntercept="-1000"))
    got, _, _ = read_dicom_series(tmp_path / "s")
    np.testing.assert_array_equal(got[:, :, 1], (stored * 2 - 1000).T)
    np.testing.assert_array_equal(got[:, :, 0], volume[:, :, 0])


def test_consecutive_acquisition_slabs_read_as_one_volume(tmp_path: Path) -> None:
    files, volume = _series(tmp_path / "s")
    for i, f in enumerate(files):
        _edit(f, _set(AcquisitionNumber=1 + i // 3))  # an axial CT numbers each rotation
    got, affine, _ = read_dicom_series(tmp_path / "s")
    np.testing.assert_array_equal(got, volume)
    np.testing.assert_allclose(affine, AFFINE, atol=1e-6)


def test_qform_only_and_agreeing_sform_qform(tmp_path: Path) -> None:
    for name, kw in (("q.nii.gz", {"scode": 0}), ("s.nii.gz", {"qcode": 0}), ("both.nii.gz", {})):
        _, affine = checks.open_nifti(_nifti(tmp_path / name, **kw))
        np.testing.assert_allclose(affine, AFFINE, atol=1e-5)


def test_sform_wins_over_a_slightly_different_qform(tmp_path: Path) -> None:
    qform = AFFINE.copy()
    qform[:3, 3] += 0.4
    _, affine = checks.open_nifti(_nifti(tmp_path / "a.nii.gz", qform=qform))
    np.testing.assert_allclose(affine, AFFINE, atol=1e-6)


def test_header_bigger_than_memory_refused_before_reading(tmp_path: Path) -> None:
    path = _raw_header_nifti(tmp_path / "big.nii.gz", (30000, 30000, 30000), b"\0" * 2**20, np.float32)
    with pytest.raises(DataError, match="more than a|of memory"):
        checks.open_nifti(path)
    with pytest.raises(DataError, match="of memory"):
        checks.check_memory(30000**3, 4, "big.nii.gz")


def test_classification_output_folder_is_created(cls_run, tmp_path: Path, capsys) -> None:
    src = next((Path(cls_run.run_dir).parent).rglob("*.nii.gz"), None) or _nifti(tmp_path / "scan.nii.gz")
    out = tmp_path / "new" / "deeper" / "p.json"
    assert main(["infer", "--run", str(cls_run.run_dir), "--input", str(src), "--output", str(out)]) == 0
    assert out.is_file() and "probabilities" in out.read_text()


def test_viewer_upload_shares_the_checks(tmp_path: Path) -> None:
    from medseg.apps.upload import UploadedBytes, read_upload

    files, volume = _series(tmp_path / "s")
    for f in files:
        _no_preamble(f)
    result = read_upload([UploadedBytes(f.name, f.read_bytes()) for f in files])
    assert result.image is not None and tuple(result.image.shape[1:]) == volume.shape
    assert result.headers is not None and len(result.headers) == 6
    bomb = _raw_header_nifti(tmp_path / "bomb.nii.gz", (4096, 4096, 1024), b"\0" * 2**16)
    # refused from its header, before decompression: by the viewer's own decompressed-size cap
    # (apps.limits) when the header is over it, else by the shared memory check
    with pytest.raises(DataError, match="more than a|it was not decompressed"):
        read_upload([UploadedBytes("bomb.nii.gz", bomb.read_bytes())])
    no_geometry = _nifti(tmp_path / "ng.nii.gz", scode=0, qcode=0)
    with pytest.raises(DataError, match="neither an sform nor a qform"):
        read_upload([UploadedBytes("ng.nii.gz", no_geometry.read_bytes())])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    angles=st.tuples(*[st.floats(-180, 180, allow_nan=False)] * 3),
    spacing=st.tuples(*[st.floats(0.3, 5.0, allow_nan=False)] * 3),
    flips=st.tuples(*[st.sampled_from([-1.0, 1.0])] * 3),
    shape=st.tuples(st.integers(2, 7), st.integers(2, 7), st.integers(2, 6)),
    origin=st.tuples(*[st.floats(-300, 300, allow_nan=False)] * 3),
)
def test_property_convert_and_to_dicom_round_trip_geometry(angles, spacing, flips, shape, origin) -> None:
    """NIfTI -> `data to-dicom` -> `data convert` keeps the affine, the shape and the voxels."""
    affine = np.eye(4)
    affine[:3, :3] = Rotation.from_euler("xyz", angles, degrees=True).as_matrix() @ np.diag(
        np.array(spacing) * np.array(flips)
    )
    affine[:3, 3] = origin
    data = np.random.default_rng(0).integers(-1000, 1000, size=shape).astype(np.int16)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        save_nifti(data, affine, tmp_path / "in.nii.gz")
        assert main(["data", "to-dicom", str(tmp_path / "in.nii.gz"), str(tmp_path / "dcm")]) == 0
        # the series' own headers (IPP/IOP/PixelSpacing) put every voxel where the affine does
        header_affine, header_shape = dicom_series_geometry(tmp_path / "dcm")
        _same_grid(affine, shape, header_affine, header_shape)
        assert main(["data", "convert", str(tmp_path / "dcm"), str(tmp_path / "back.nii.gz")]) == 0
        back = nib.load(tmp_path / "back.nii.gz")
        index = _same_grid(affine, shape, back.affine, back.shape)
        np.testing.assert_array_equal(np.asarray(back.dataobj).reshape(-1), data[index])


def _same_grid(a: np.ndarray, shape_a: tuple, b: np.ndarray, shape_b: tuple) -> tuple[np.ndarray, ...]:
    """Assert grid b puts voxels exactly where grid a does (a k axis may come back reversed: left-handed
    affines are sorted along the DICOM normal); return b's voxels as indices into a."""
    t = np.linalg.inv(a) @ b
    assert np.allclose(t, np.rint(t), atol=1e-3), t
    assert sorted(shape_a) == sorted(shape_b)
    idx = np.indices(shape_b).reshape(3, -1)
    mapped = np.rint(t[:3, :3] @ idx + t[:3, 3:4]).astype(int)
    for axis in range(3):
        assert mapped[axis].min() == 0 and mapped[axis].max() == shape_a[axis] - 1
    return tuple(mapped)
