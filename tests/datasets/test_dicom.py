"""DICOM series read/write: real pydicom series, geometry round trips, checks, MONAI reader."""

from __future__ import annotations

import random
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch
from monai.data import MetaTensor
from monai.transforms import EnsureChannelFirst, LoadImage, Orientation
from scipy.spatial.transform import Rotation

from medseg.datasets.dicom.convert import dicom_to_nifti
from medseg.datasets.dicom.reader import DicomSeriesReader, read_dicom_series
from medseg.datasets.dicom.scan import list_series
from medseg.datasets.dicom.write import write_dicom_series
from medseg.errors import DataError

DICOMDIR_TESTS = Path(pydicom.__file__).parent / "data/test_files/dicomdirtests"
CT5N = DICOMDIR_TESTS / "98892001/CT5N"
CT2 = DICOMDIR_TESTS / "77654033/CT2"
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0])


def _affine(
    rotation: np.ndarray, spacing: tuple[float, float, float], origin: tuple[float, ...]
) -> np.ndarray:
    aff = np.eye(4)
    aff[:3, :3] = rotation @ np.diag(spacing)
    aff[:3, 3] = origin
    return aff


def _oblique() -> np.ndarray:
    rot = Rotation.from_euler("xy", [25.0, -40.0], degrees=True).as_matrix()
    return _affine(rot, (0.7, 0.9, 2.5), (12.5, -80.25, 33.0))


def _volume(shape: tuple[int, int, int] = (24, 18, 6), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) * 300.0 + 40.0).astype(np.float32)


def _slope(folder: Path) -> float:
    return float(pydicom.dcmread(next(folder.glob("*.dcm")), stop_before_pixels=True).RescaleSlope)


def test_real_ct5n_reads_with_geometry_of_each_file():
    volume, affine, meta = read_dicom_series(CT5N)
    assert volume.shape == (16, 16, 5) and volume.dtype == np.float32
    assert meta["spacing"] == pytest.approx([0.488281, 0.488281, 2.5], abs=1e-6)
    assert meta["n_slices"] == 5 and meta["modality"] == "CT" and not meta["resampled"]
    assert meta["filename_or_obj"] == str(CT5N)
    datasets = sorted(
        (pydicom.dcmread(p) for p in CT5N.iterdir()), key=lambda d: float(d.ImagePositionPatient[2])
    )
    for k, ds in enumerate(datasets):
        ipp_ras = LPS_TO_RAS @ np.array([float(v) for v in ds.ImagePositionPatient])
        np.testing.assert_allclose((affine @ [0, 0, k, 1])[:3], ipp_ras, atol=1e-3)
        expected = ds.pixel_array.T * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
        np.testing.assert_allclose(volume[:, :, k], expected)


def test_real_ct2_missing_slices_refused_then_resampled():
    with pytest.raises(DataError, match=r"missing slice.*resample=True") as exc:
        read_dicom_series(CT2)
    assert "-99.480" in str(exc.value) and "103.020" in str(exc.value)
    volume, affine, meta = read_dicom_series(CT2, resample=True)
    assert meta["resampled"] and meta["spacing"][2] == pytest.approx(1.25, abs=1e-6)
    assert volume.shape == (16, 16, 165) and meta["n_files"] == 4
    np.testing.assert_allclose(affine[:3, 3], [125.0, 128.100006, -99.480003], atol=1e-4)
    np.testing.assert_allclose((affine @ [0, 0, 164, 1])[2], 105.519997, atol=1e-4)
    last = pydicom.dcmread(CT2 / "17196")
    np.testing.assert_allclose(volume[:, :, -1], last.pixel_array.T - 1024.0)


def _assert_round_trip(tmp_path: Path, affine: np.ndarray, expect_affine: np.ndarray, flip_k: bool) -> None:
    volume = _volume()
    write_dicom_series(volume, affine, tmp_path / "s")
    read, read_affine, meta = read_dicom_series(tmp_path / "s")
    np.testing.assert_allclose(read_affine, expect_affine, atol=1e-4)
    expected = volume[:, :, ::-1] if flip_k else volume
    assert read.shape == volume.shape
    assert np.abs(read - expected).max() <= _slope(tmp_path / "s") / 2 + 1e-3
    assert meta["spacing"] == pytest.approx(np.linalg.norm(affine[:3, :3], axis=0), abs=1e-5)


def test_round_trip_oblique_anisotropic(tmp_path):
    affine = _oblique()
    _assert_round_trip(tmp_path, affine, affine, flip_k=False)


@pytest.mark.parametrize(
    "columns",
    [
        [[-1, 0, 0], [0, -1, 0], [0, 0, 1]],  # LPS
        [[0, 0, -1], [-1, 0, 0], [0, 1, 0]],  # PSL (permuted axes)
    ],
)
def test_round_trip_flipped_and_permuted(tmp_path, columns):
    affine = _affine(np.array(columns, dtype=float).T, (0.8, 1.1, 3.0), (-5.0, 7.5, 100.0))
    _assert_round_trip(tmp_path, affine, affine, flip_k=False)


def test_round_trip_left_handed_axes_sorted_along_normal(tmp_path):
    # LAS (radiological) has det < 0: slices come back sorted along the DICOM normal, k reversed,
    # and the affine describes the same voxels in the same places.
    affine = _affine(np.diag([-1.0, 1.0, 1.0]), (0.7, 0.7, 2.0), (10.0, 20.0, 30.0))
    n = _volume().shape[2]
    flip = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, -1, n - 1], [0, 0, 0, 1]], dtype=float)
    _assert_round_trip(tmp_path, affine, affine @ flip, flip_k=True)


def test_integer_data_is_lossless_and_headers_are_valid(tmp_path):
    volume = np.random.default_rng(1).integers(-1024, 3000, size=(10, 12, 3)).astype(np.int16)
    paths = write_dicom_series(volume, np.diag([0.5, 0.6, 1.5, 1.0]), tmp_path / "ct", patient_id="P7")
    assert [p.name for p in paths] == ["slice_0000.dcm", "slice_0001.dcm", "slice_0002.dcm"]
    ds = pydicom.dcmread(paths[1])
    assert ds.file_meta.TransferSyntaxUID == pydicom.uid.ExplicitVRLittleEndian
    assert ds.SOPClassUID == pydicom.uid.CTImageStorage and ds.PatientID == "P7"
    assert (ds.Rows, ds.Columns, ds.InstanceNumber) == (12, 10, 2)
    assert [float(v) for v in ds.PixelSpacing] == [0.6, 0.5]
    assert float(ds.RescaleSlope) == 1.0 and ds.PixelRepresentation == 1
    np.testing.assert_array_equal(ds.pixel_array, volume[:, :, 1].T)
    uids = {(d.StudyInstanceUID, d.SeriesInstanceUID) for d in map(pydicom.dcmread, paths)}
    assert len(uids) == 1 and len({pydicom.dcmread(p).SOPInstanceUID for p in paths}) == 3
    read, _, _ = read_dicom_series(tmp_path / "ct")
    np.testing.assert_array_equal(read, volume.astype(np.float32))
    assert not list((tmp_path / "ct").glob(".*")), "temporary files left behind"


def test_refuses_to_overwrite_unless_asked(tmp_path):
    write_dicom_series(_volume((8, 8, 4)), np.eye(4), tmp_path / "s")
    with pytest.raises(DataError, match=r"already holds 4 \.dcm.*overwrite=True"):
        write_dicom_series(_volume((8, 8, 2)), np.eye(4), tmp_path / "s")
    write_dicom_series(_volume((8, 8, 2)), np.eye(4), tmp_path / "s", overwrite=True)
    assert len(list((tmp_path / "s").glob("*.dcm"))) == 2
    assert read_dicom_series(tmp_path / "s")[0].shape == (8, 8, 2)


def test_dicom_to_nifti(tmp_path):
    affine = _oblique()
    write_dicom_series(_volume(), affine, tmp_path / "s")
    out = dicom_to_nifti(tmp_path / "s", tmp_path / "out" / "vol.nii.gz")
    assert out == tmp_path / "out" / "vol.nii.gz" and not list(out.parent.glob(".tmp-*"))
    with open(out, "rb") as f:
        assert f.read(2) == b"\x1f\x8b"  # gzip
    img = nib.load(out)
    assert img.shape == _volume().shape
    np.testing.assert_allclose(img.affine, affine, atol=1e-3)
    np.testing.assert_allclose(img.get_qform(), affine, atol=1e-3)
    assert int(img.header["sform_code"]) == 1 and int(img.header["qform_code"]) == 1


def test_two_series_listed_and_chosen(tmp_path):
    write_dicom_series(_volume((8, 8, 3)), np.eye(4), tmp_path / "a", series_description="first")
    write_dicom_series(_volume((6, 6, 2)), np.eye(4), tmp_path / "b", series_description="second")
    (tmp_path / "README.txt").write_text("not DICOM")
    series = {s.description: s for s in list_series(tmp_path)}
    assert set(series) == {"first", "second"} and series["first"].n_files == 3
    with pytest.raises(DataError, match="--series UID") as exc:
        read_dicom_series(tmp_path)
    assert series["first"].uid in str(exc.value) and series["second"].uid in str(exc.value)
    volume, _, meta = read_dicom_series(tmp_path, series_uid=series["second"].uid)
    assert volume.shape == (6, 6, 2) and meta["series_description"] == "second"
    with pytest.raises(DataError, match=r"no series with UID 1\.2\.3") as exc:
        read_dicom_series(tmp_path, series_uid="1.2.3")
    assert series["first"].uid in str(exc.value)


def test_empty_and_non_dicom_folders(tmp_path):
    with pytest.raises(DataError, match="holds no DICOM files"):
        read_dicom_series(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "DICOMDIR").write_bytes(b"\0" * 200)
    with pytest.raises(DataError, match="holds no DICOM files"):
        read_dicom_series(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.2, 0.3])  # cut in the pixels, or inside the header
def test_truncated_file_named(tmp_path, keep):
    paths = write_dicom_series(_volume((32, 32, 3)), np.eye(4), tmp_path / "s")
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(DataError, match="slice_0001.dcm"):
        read_dicom_series(tmp_path / "s")


def test_missing_middle_slice(tmp_path):
    paths = write_dicom_series(_volume((8, 8, 6)), _affine(np.eye(3), (1, 1, 2.0), (0, 0, 0)), tmp_path / "s")
    paths[3].unlink()
    with pytest.raises(DataError, match=r"1 missing slice\(s\) between positions 4\.000 and 8\.000"):
        read_dicom_series(tmp_path / "s")


def test_uneven_spacing_reported(tmp_path):
    paths = write_dicom_series(_volume((8, 8, 5)), np.eye(4), tmp_path / "s")
    ds = pydicom.dcmread(paths[2])
    ds.ImagePositionPatient = [0, 0, 2.4]
    ds.save_as(paths[2])
    with pytest.raises(DataError, match=r"uneven slice spacing: gaps \[1\.0, 1\.4, 0\.6, 1\.0\]"):
        read_dicom_series(tmp_path / "s")
    volume, affine, meta = read_dicom_series(tmp_path / "s", resample=True)
    assert meta["resampled"] and volume.shape[2] == 5 and affine[2, 2] == pytest.approx(1.0)


def test_shuffled_names_read_in_position_order(tmp_path):
    volume = _volume((8, 9, 7))
    paths = write_dicom_series(volume, _oblique(), tmp_path / "s")
    names = [f"img{n}.dcm" for n in random.Random(3).sample(range(100), len(paths))]
    for path, name in zip(paths, names, strict=True):
        path.rename(tmp_path / "s" / name)
    read, affine, _ = read_dicom_series(tmp_path / "s")
    np.testing.assert_allclose(affine, _oblique(), atol=1e-4)
    assert np.abs(read - volume).max() <= _slope(tmp_path / "s") / 2 + 1e-3


def test_monai_load_image_with_reader(tmp_path):
    affine = _oblique()
    volume = _volume()
    write_dicom_series(volume, affine, tmp_path / "s")
    reader = DicomSeriesReader()
    assert reader.verify_suffix(tmp_path / "s") and reader.verify_suffix([str(tmp_path / "s")])
    assert reader.verify_suffix(tmp_path / "s" / "slice_0000.dcm")  # one file: a multi-frame image, say
    nib.save(nib.Nifti1Image(volume, affine), tmp_path / "v.nii")
    assert not reader.verify_suffix(tmp_path / "v.nii") and not reader.verify_suffix(tmp_path / "none.dcm")
    img = LoadImage(reader=reader, image_only=True)(tmp_path / "s")
    assert isinstance(img, MetaTensor) and tuple(img.shape) == volume.shape
    np.testing.assert_allclose(img.affine.numpy(), affine, atol=1e-4)
    assert img.meta["filename_or_obj"] == str(tmp_path / "s") and img.meta["series_uid"]
    img = EnsureChannelFirst()(img)
    assert tuple(img.shape) == (1, *volume.shape)
    ras = Orientation(axcodes="RAS")(img)
    assert nib.aff2axcodes(ras.affine.numpy()) == ("R", "A", "S")
    # the world position of the brightest voxel does not move when reorienting
    src = np.unravel_index(int(torch.argmax(img[0])), volume.shape)
    dst = np.unravel_index(int(torch.argmax(ras[0])), ras.shape[1:])
    np.testing.assert_allclose(
        (img.affine.numpy() @ [*src, 1])[:3], (ras.affine.numpy() @ [*dst, 1])[:3], atol=1e-3
    )


def test_monai_load_image_does_not_fall_back_to_averaging_reader():
    with pytest.raises(DataError, match="missing slice"):
        LoadImage(reader=DicomSeriesReader(), image_only=True)(CT2)
    img = LoadImage(reader=DicomSeriesReader(resample=True), image_only=True)(CT2)
    assert tuple(img.shape) == (16, 16, 165)


def test_single_slice_label_mask_keeps_thickness(tmp_path):
    mask = np.zeros((5, 6, 1), dtype=bool)
    mask[1:3, 2:4] = True
    write_dicom_series(mask, np.diag([2.0, 3.0, 4.0, 1.0]), tmp_path / "m")
    volume, affine, meta = read_dicom_series(tmp_path / "m")
    np.testing.assert_array_equal(volume, mask.astype(np.float32))
    np.testing.assert_allclose(affine, np.diag([2.0, 3.0, 4.0, 1.0]), atol=1e-6)
    assert meta["spacing"] == [2.0, 3.0, 4.0]


def test_writer_rejects_sheared_plane(tmp_path):
    affine = np.eye(4)
    affine[0, 1] = 0.5
    with pytest.raises(DataError, match="shears the i/j plane"):
        write_dicom_series(_volume((4, 4, 2)), affine, tmp_path / "s")


def test_big_endian_slice_without_preamble_is_read_not_skipped(tmp_path):
    # Explicit VR Big Endian (retired, still in archives) with neither preamble nor file meta: its first
    # bytes are 00 08, not 08 00. Skipping it would leave a 2-slice volume with one regular gap.
    volume = _volume((6, 5, 3))
    paths = write_dicom_series(volume, np.diag([0.5, 0.6, 2.0, 1.0]), tmp_path / "s")
    ds = pydicom.dcmread(paths[1])
    stored = ds.pixel_array
    ds.preamble = None
    del ds.file_meta
    ds.PixelData = stored.astype(">i2").tobytes()
    pydicom.dcmwrite(paths[1], ds, implicit_vr=False, little_endian=False, enforce_file_format=False)
    assert paths[1].read_bytes()[:2] == b"\x00\x08"
    read, affine, meta = read_dicom_series(tmp_path / "s")
    assert meta["n_slices"] == 3
    assert np.abs(read - volume).max() <= _slope(tmp_path / "s") / 2 + 1e-3
    # an image without its UIDs is named and refused, not dropped from the volume without a word
    ds = pydicom.dcmread(paths[2])
    for tag in ("SOPClassUID", "SOPInstanceUID", "SeriesInstanceUID"):
        delattr(ds, tag)
    ds.preamble = None
    del ds.file_meta
    pydicom.dcmwrite(paths[2], ds, implicit_vr=True, little_endian=True, enforce_file_format=False)
    with pytest.raises(DataError, match=r"slice_0002\.dcm has an incomplete DICOM header"):
        read_dicom_series(tmp_path / "s")
