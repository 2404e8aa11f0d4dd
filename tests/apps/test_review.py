"""Review and correct, without a browser: applying the viewport's edit runs, reading an uploaded
mask against the scan's grid, Dice per label."""

from __future__ import annotations

import gzip

import nibabel as nib
import numpy as np
import pytest
from monai.data import MetaTensor

from medseg.apps import review
from medseg.errors import DataError

AFFINE = np.array([[-0.8, 0, 0, 40.0], [0, -0.8, 0, 30.0], [0, 0, 2.5, -60.0], [0, 0, 0, 1]])


def nifti(array: np.ndarray, affine: np.ndarray = AFFINE, gz: bool = False) -> bytes:
    data = nib.Nifti1Image(array, affine).to_bytes()
    return gzip.compress(data) if gz else data


def test_edit_runs_follow_the_stored_i_fastest_order() -> None:
    label = np.zeros((4, 3, 2), np.uint8)
    label[1, 1, 1] = 1
    # flat i-fastest: index = i + 4 j + 12 k
    fixed = review.apply_edits(label, [[0 + 4 * 2 + 12 * 1, 3, 2], [1 + 4 * 1 + 12 * 1, 1, 0]])
    want = label.copy()
    want[0:3, 2, 1] = 2
    want[1, 1, 1] = 0
    np.testing.assert_array_equal(fixed, want)
    assert label[1, 1, 1] == 1  # the model's mask is not touched


def test_edits_outside_the_map_are_refused() -> None:
    with pytest.raises(DataError, match="outside this label map"):
        review.apply_edits(np.zeros((2, 2, 2), np.uint8), [[7, 2, 1]])


def test_edited_label_keeps_the_grid() -> None:
    label = MetaTensor(np.zeros((1, 3, 3, 3), np.uint8), affine=AFFINE)
    fixed = review.edited_label(label, [[13, 1, 2]])
    assert fixed.shape == (1, 3, 3, 3) and fixed[0, 1, 1, 1] == 2 and int(fixed.sum()) == 2
    np.testing.assert_array_equal(np.asarray(fixed.affine), AFFINE)


@pytest.mark.parametrize("gz", [False, True])
def test_mask_on_the_scan_grid_is_read(gz: bool) -> None:
    mask = np.zeros((5, 4, 3), np.int16)
    mask[2, 1, 0] = 2
    got = review.read_mask("ref.nii.gz" if gz else "ref.nii", nifti(mask, gz=gz), (5, 4, 3), AFFINE)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, mask)


def test_mask_of_another_size_is_refused_in_plain_words() -> None:
    with pytest.raises(
        DataError, match=r"ref.nii does not fit this scan: it has 5 × 4 × 2 voxels, the scan 5 × 4 × 3"
    ):
        review.read_mask("ref.nii", nifti(np.zeros((5, 4, 2), np.uint8)), (5, 4, 3), AFFINE)


def test_mask_elsewhere_in_the_patient_is_refused() -> None:
    moved = AFFINE.copy()
    moved[0, 3] += 4.0
    with pytest.raises(DataError, match=r"lies elsewhere in the patient .*4.0 mm"):
        review.read_mask("ref.nii", nifti(np.zeros((5, 4, 3), np.uint8), moved), (5, 4, 3), AFFINE)
    flipped = AFFINE.copy()
    flipped[0, 0] = 0.8  # same size and origin, mirrored left-right
    with pytest.raises(DataError, match="elsewhere"):
        review.read_mask("ref.nii", nifti(np.zeros((5, 4, 3), np.uint8), flipped), (5, 4, 3), AFFINE)


def test_not_a_label_map_is_refused() -> None:
    with pytest.raises(DataError, match="is not a NIfTI file"):
        review.read_mask("notes.nii", b"hello, this is text", (5, 4, 3), AFFINE)
    with pytest.raises(DataError, match="fractional"):
        review.read_mask("prob.nii", nifti(np.full((5, 4, 3), 0.5, np.float32)), (5, 4, 3), AFFINE)


def test_dice_per_label() -> None:
    a = np.zeros((4, 4, 4), np.uint8)
    b = np.zeros((4, 4, 4), np.uint8)
    a[0, 0, :] = 1  # 4 voxels
    b[0, 0, :2] = 1  # 2 of them
    b[3, 3, 3] = 2  # only in b
    rows = {
        r["label"]: r for r in review.dice_table(a, b, {0: "background", 1: "organ", 2: "lesion", 3: "cyst"})
    }
    assert rows["organ"]["Dice"] == pytest.approx(2 * 2 / 6)
    assert (rows["organ"]["voxels A"], rows["organ"]["voxels B"]) == (4, 2)
    assert rows["lesion"]["Dice"] == 0.0
    assert rows["cyst"]["Dice"] is None  # in neither mask
    assert "background" not in rows


def test_outline_keeps_only_edges() -> None:
    lab = np.zeros((7, 7, 7), np.uint8)
    lab[1:6, 1:6, 1:6] = 2
    edge = review.outline(lab)
    assert edge[3, 3, 3] == 0  # inside
    assert edge[1, 3, 3] == 2 and edge[3, 5, 3] == 2  # faces
    assert edge[3, 3, 1] == 0  # the object's first slice: edges only at its rim, not filled
    assert int((edge > 0).sum()) == 5 * (5**2 - 3**2)
    assert not edge[lab == 0].any()
