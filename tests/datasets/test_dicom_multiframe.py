"""Enhanced multi-frame DICOM: files made here by highdicom's legacy converter, geometry checked against
dcm2niix (an independent implementation) by the world position of the corner voxels.

Each single-frame series is converted into one Legacy Converted Enhanced CT or MR file whose frames are
stored in a shuffled order, so that reading them in file order would put slices in the wrong place.
"""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from pydicom.uid import EnhancedCTImageStorage

from medseg.cli.main import main
from medseg.datasets.dicom.reader import read_dicom_series
from medseg.datasets.dicom.write import write_dicom_series
from tests.datasets.test_dicom import CT5N, _affine, _oblique, _volume
from tests.datasets.test_fuzz_input import _no_preamble
from tests.enhanced import to_multiframe
from tests.geometry import corner_voxel_error, dcm2niix, oblique

TOLERANCE_MM = 1e-3


def _case_series(name: str, root: Path) -> Path:
    """The single-frame series of each case: written by medseg, or real CT slices from pydicom."""
    if name == "ct5n":
        return CT5N
    if name == "ct-oblique":
        write_dicom_series(_volume((24, 18, 7), seed=3), _oblique(), root / "series")
    elif name == "mr-sagittal-oblique-left-handed":
        # P, S, L axes (sagittal), turned off-axis, a left-handed grid, anisotropic, non-integer values
        axes = np.array([[0, 0, -1], [-1, 0, 0], [0, 1, 0]], float).T @ np.diag([1.0, 1.0, -1.0])
        affine = oblique(_affine(axes, (1.1, 0.8, 3.3), (-20.0, 41.5, -7.25)), (8.0, 15.0, -30.0))
        write_dicom_series(_volume((20, 26, 5), seed=4) / 7.0, affine, root / "series", modality="MR")
    return root / "series"


CASES = ["ct-oblique", "mr-sagittal-oblique-left-handed", "ct5n"]


@pytest.mark.parametrize("name", CASES)
def test_multiframe_geometry_matches_dcm2niix(tmp_path: Path, name: str, capsys) -> None:
    series = _case_series(name, tmp_path)
    mf = to_multiframe(series, tmp_path / "mf", mr=name.startswith("mr"), seed=len(name))
    out = tmp_path / "medseg.nii.gz"
    assert main(["data", "convert", str(mf), str(out)]) == 0, capsys.readouterr().err
    mine = nib.load(out)
    ref_volume, ref_affine = dcm2niix(mf.parent, tmp_path / "dcm2niix")
    error = corner_voxel_error(np.asarray(mine.dataobj), mine.affine, ref_volume, ref_affine)
    print(f"corner-voxel max error vs dcm2niix, multi-frame {name}: {error:.3g} mm")  # docs/design.md
    assert error <= TOLERANCE_MM, f"{name}: corner voxels {error:.3g} mm away from dcm2niix's"
    # and the same volume as the single-frame series it was made from, through the folder path too
    series_volume, series_affine, _ = read_dicom_series(series)
    volume, affine, meta = read_dicom_series(mf.parent)
    assert meta["n_frames"] == series_volume.shape[2] and meta["sop_class"].startswith("Legacy Converted")
    np.testing.assert_allclose(affine, series_affine, atol=1e-4)
    np.testing.assert_allclose(volume, series_volume, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("name", ["ct-oblique", "ct5n"])
def test_single_frame_convert_matches_dcm2niix(tmp_path: Path, name: str, capsys) -> None:
    series = _case_series(name, tmp_path)
    out = tmp_path / "medseg.nii.gz"
    assert main(["data", "convert", str(series), str(out)]) == 0, capsys.readouterr().err
    mine = nib.load(out)
    ref_volume, ref_affine = dcm2niix(series, tmp_path / "dcm2niix")
    error = corner_voxel_error(np.asarray(mine.dataobj), mine.affine, ref_volume, ref_affine)
    print(f"corner-voxel max error vs dcm2niix, single-frame series {name}: {error:.3g} mm")
    assert error <= TOLERANCE_MM, f"{name}: corner voxels {error:.3g} mm away from dcm2niix's"


def test_enhanced_ct_sop_class_and_file_without_preamble(tmp_path: Path) -> None:
    series = _case_series("ct-oblique", tmp_path)
    mf = to_multiframe(series, tmp_path / "mf")
    expected_volume, expected_affine, _ = read_dicom_series(series)
    ds = pydicom.dcmread(mf)
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = EnhancedCTImageStorage
    ds.save_as(tmp_path / "enhanced.dcm", enforce_file_format=True)
    bare = tmp_path / "bare" / "enhanced-no-preamble.dcm"
    bare.parent.mkdir()
    _no_preamble(tmp_path / "enhanced.dcm", bare)
    assert bare.read_bytes()[128:132] != b"DICM"
    for path, sop in ((tmp_path / "enhanced.dcm", "Enhanced CT"), (bare.parent, "Enhanced CT")):
        volume, affine, meta = read_dicom_series(path)
        assert meta["sop_class"] == sop
        np.testing.assert_allclose(affine, expected_affine, atol=1e-4)
        np.testing.assert_allclose(volume, expected_volume, rtol=1e-6, atol=1e-4)


def test_rescale_is_applied_per_frame(tmp_path: Path) -> None:
    """PixelValueTransformationSequence moved into the per-frame groups, one frame with its own scale."""
    series = _case_series("ct-oblique", tmp_path)
    mf = to_multiframe(series, tmp_path / "mf")
    ds = pydicom.dcmread(mf)
    shared = ds.SharedFunctionalGroupsSequence[0]
    transform = shared.PixelValueTransformationSequence[0]
    del shared.PixelValueTransformationSequence
    odd = 2  # this frame's values are stored * 3 - 500
    for f, item in enumerate(ds.PerFrameFunctionalGroupsSequence):
        own = pydicom.Dataset()
        own.RescaleSlope, own.RescaleIntercept = (
            ("3", "-500")
            if f == odd
            else (
                transform.RescaleSlope,
                transform.RescaleIntercept,
            )
        )
        own.RescaleType = transform.RescaleType
        item.PixelValueTransformationSequence = pydicom.Sequence([own])
    ds.save_as(mf, enforce_file_format=True)
    expected_volume, _, _ = read_dicom_series(series)
    volume, _, _ = read_dicom_series(mf)
    iop = np.array(shared.PlaneOrientationSequence[0].ImageOrientationPatient, float)
    d = [
        float(np.cross(iop[:3], iop[3:]) @ np.array(f.PlanePositionSequence[0].ImagePositionPatient, float))
        for f in ds.PerFrameFunctionalGroupsSequence
    ]
    k = sorted(d).index(d[odd])  # where that frame lands along the normal
    np.testing.assert_allclose(volume[:, :, k], ds.pixel_array[odd].T * 3.0 - 500.0, rtol=1e-6)
    others = [i for i in range(volume.shape[2]) if i != k]
    np.testing.assert_allclose(volume[:, :, others], expected_volume[:, :, others], rtol=1e-6, atol=1e-4)


def test_viewer_upload_reads_a_multiframe_file(tmp_path: Path) -> None:
    from medseg.apps.upload import UploadedBytes, read_upload

    series = _case_series("ct-oblique", tmp_path)
    mf = to_multiframe(series, tmp_path / "mf")
    result = read_upload([UploadedBytes(mf.name, mf.read_bytes())])
    expected_volume, expected_affine, _ = read_dicom_series(series)
    assert result.source == "DICOM" and result.headers is None  # no DICOM-SEG export for it (yet)
    np.testing.assert_allclose(result.image.affine.numpy(), expected_affine, atol=1e-4)
    np.testing.assert_allclose(result.image[0].numpy(), expected_volume, rtol=1e-6, atol=1e-4)


def test_infer_accepts_a_multiframe_file(seg_run, seg_data: Path, tmp_path: Path, capsys) -> None:
    """`medseg infer --input FILE.dcm` on a multi-frame file gives the mask of the series it came from."""
    scan = nib.load(next((seg_data / "imagesTs").glob("*.nii.gz")))
    write_dicom_series(np.asarray(scan.dataobj), oblique(scan.affine), tmp_path / "series")
    mf = to_multiframe(tmp_path / "series", tmp_path / "mf", seed=5)
    outs = []
    for source, name in ((mf, "mf.nii.gz"), (tmp_path / "series", "series.nii.gz")):
        out = tmp_path / name
        code = main(["infer", "--run", str(seg_run.run_dir), "--input", str(source), "--output", str(out)])
        assert code == 0, capsys.readouterr().err
        outs.append(nib.load(out))
    mask = np.asarray(outs[0].dataobj)
    assert 0 < np.count_nonzero(mask) < mask.size / 2, "the model found nothing to segment: a weak check"
    np.testing.assert_allclose(outs[0].affine, outs[1].affine, atol=1e-4)
    np.testing.assert_array_equal(mask, np.asarray(outs[1].dataobj))
