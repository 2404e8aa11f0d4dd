"""The uploaded NIfTI file as the viewport's volume (apps/upload.py ``viewer_nifti``): taken as it is
only when NiiVue will put its voxels where medseg's reader does, refused otherwise; and the
reduced-resolution preview a large one is painted from first (``preview_nifti``).

Real files written with nibabel and read back with medseg's own reader (``load_image``).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medseg.apps.upload import UploadedBytes, preview_nifti, viewer_nifti
from medseg.inference.io import load_image

OBLIQUE = np.array(
    [
        [-0.7, 0.05, 0.0, 120.0],
        [0.04, -0.69, 0.1, 90.0],
        [0.0, 0.08, 2.5, -40.0],
        [0.0, 0.0, 0.0, 1.0],
    ]
)


def write(
    path: Path, data: np.ndarray, affine: np.ndarray, scode: int = 1, qcode: int = 1, qform=None
) -> bytes:
    img = nib.Nifti1Image(data, affine)
    img.header.set_sform(affine, code=scode)
    img.header.set_qform(affine if qform is None else qform, code=qcode)
    nib.save(img, path)
    return path.read_bytes()


def volume(shape=(12, 10, 6)) -> np.ndarray:
    return np.random.default_rng(0).integers(-1000, 1000, shape).astype(np.int16)


@pytest.mark.parametrize("suffix, name", [(".nii.gz", "scan.nii.gz"), (".nii", "scan.nii")])
def test_the_upload_is_sent_as_it_is_with_medsegs_geometry(tmp_path: Path, suffix: str, name: str) -> None:
    path = tmp_path / f"ct{suffix}"
    data = write(path, volume(), OBLIQUE, scode=2, qcode=1)
    got = viewer_nifti([UploadedBytes(path.name, data)])
    assert got is not None
    assert got.data is data and got.name == name and got.shape == (12, 10, 6)
    image = load_image(path)  # what the page reads afterwards
    np.testing.assert_allclose(got.affine, image.affine.numpy(), atol=1e-4)
    assert tuple(image.shape[1:]) == got.shape


def test_qform_only_and_agreeing_forms(tmp_path: Path) -> None:
    path = tmp_path / "q.nii.gz"
    rigid = np.diag([-0.8, -0.8, 2.0, 1.0])
    got = viewer_nifti([UploadedBytes(path.name, write(path, volume(), rigid, scode=0, qcode=1))])
    assert got is not None
    np.testing.assert_allclose(got.affine, load_image(path).affine.numpy(), atol=1e-4)
    # sform code below the qform's (NiiVue takes the qform, medseg the sform): fine while they agree
    same = write(path, volume(), rigid, scode=1, qcode=2)
    assert viewer_nifti([UploadedBytes(path.name, same)]) is not None


def test_not_sent_as_it_is(tmp_path: Path) -> None:
    rigid = np.diag([-0.8, -0.8, 2.0, 1.0])
    moved = rigid.copy()
    moved[0, 3] += 5.0
    cases = {
        # NiiVue would place it by the qform, medseg by the sform, 5 mm apart
        "forms.nii.gz": write(tmp_path / "forms.nii.gz", volume(), rigid, scode=1, qcode=2, qform=moved),
        "4d.nii.gz": write(tmp_path / "4d.nii.gz", volume((6, 5, 4, 2)), rigid),
        "flat.nii.gz": write(tmp_path / "flat.nii.gz", volume((6, 5, 1)), rigid),
        "complex.nii.gz": write(tmp_path / "complex.nii.gz", volume().astype(np.complex64), rigid),
        "broken.nii.gz": gzip.compress(b"not a nifti header at all" * 20),
    }
    for name, data in cases.items():
        assert viewer_nifti([UploadedBytes(name, data)]) is None, name
    ok = write(tmp_path / "ok.nii.gz", volume(), rigid)
    assert viewer_nifti([UploadedBytes("ok.nii.gz", ok)]) is not None
    assert viewer_nifti([UploadedBytes("ok.nii.gz", ok), UploadedBytes("b.nii.gz", ok)]) is None
    assert viewer_nifti([UploadedBytes("series.zip", ok)]) is None


@pytest.mark.parametrize("suffix", [".nii.gz", ".nii"])
def test_preview_keeps_every_nth_voxel_at_its_world_position(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"big{suffix}"
    img = nib.Nifti1Image(volume((13, 10, 7)), OBLIQUE)
    img.header.set_slope_inter(2.0, -5.0)  # scaled values: the preview keeps the scaling
    nib.save(img, path)
    full = viewer_nifti([UploadedBytes(path.name, path.read_bytes())])
    assert full is not None
    assert preview_nifti(full, above=13 * 10 * 7, max_voxels=10) is None  # small enough: sent as it is
    got = preview_nifti(full, above=100, max_voxels=7 * 5 * 4)  # step 2 leaves 7 x 5 x 4
    assert got is not None
    preview, step = got
    assert step == 2 and preview.shape == (7, 5, 4) and preview.name == "preview.nii"
    out = tmp_path / "preview.nii"
    out.write_bytes(preview.data)
    small, big = load_image(out), load_image(path)  # medseg's own reader, as the page uses
    np.testing.assert_array_equal(small[0].numpy(), big[0].numpy()[::2, ::2, ::2])
    ijk = np.array([[0, 0, 0, 1], [6, 4, 3, 1], [3, 1, 2, 1]], dtype=float)
    np.testing.assert_allclose(
        ijk @ small.affine.numpy().T, (ijk * [2, 2, 2, 1]) @ big.affine.numpy().T, atol=1e-4
    )
    np.testing.assert_allclose(preview.affine, small.affine.numpy(), atol=1e-4)
    assert viewer_nifti([UploadedBytes("preview.nii", preview.data)]) is not None  # NiiVue reads it as medseg
    assert preview_nifti(full, above=100, max_voxels=5 * 4 * 3 - 1)[1] == 4  # step 3 would leave 5 x 4 x 3
    assert preview_nifti(full) is None  # the page's thresholds: far larger scans only


def test_the_preview_threshold_is_a_setting(tmp_path: Path, monkeypatch) -> None:
    """``MEDSEG_APP_PREVIEW_ABOVE`` (voxels) moves the threshold; a value that is not a number keeps the default."""
    path = tmp_path / "scan.nii"
    nib.save(nib.Nifti1Image(volume((13, 10, 7)), OBLIQUE), path)
    full = viewer_nifti([UploadedBytes(path.name, path.read_bytes())])
    assert full is not None
    monkeypatch.setenv("MEDSEG_APP_PREVIEW_ABOVE", str(13 * 10 * 7 - 1))
    got = preview_nifti(full)
    assert got is not None and got[1] == 2
    monkeypatch.setenv("MEDSEG_APP_PREVIEW_ABOVE", str(13 * 10 * 7))
    assert preview_nifti(full) is None
    monkeypatch.setenv("MEDSEG_APP_PREVIEW_ABOVE", "lots")
    assert preview_nifti(full) is None
