"""The viewer's Compare panel, driven by AppTest against real bundles and real files: an existing
mask uploaded beside the model's (its ground truth), a mask on another grid refused in plain words,
and a second model run on the same case; Dice per label checked against numpy on ``predict``'s masks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from medseg.bundle.load import load_bundle
from medseg.datasets.decathlon import load_dataset
from medseg.inference.io import load_image
from medseg.inference.predict import predict
from medseg.training.loop import train
from tests.apps.test_app import errors, new_app, page_text, run_model, upload_files
from tests.conftest import tiny_seg_config


@pytest.fixture(scope="module")
def second_run(seg_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """Another segmentation model of the same labels: the tiny UNet trained for 2 epochs, not 8."""
    return train(
        tiny_seg_config(seg_data, tmp_path_factory.mktemp("runs-b"), name="tiny-seg-b", epochs=2),
        progress=False,
    )


@pytest.fixture(scope="module")
def two_models(seg_run, second_run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("review-runs")
    for run in (seg_run, second_run):
        shutil.copytree(run.run_dir / "bundle", root / run.run_dir.name / "bundle")
    return root


@pytest.fixture(scope="module")
def case(seg_data: Path) -> dict:
    """A case with its ground-truth label (a training case: the test case has none)."""
    return load_dataset(seg_data).training[0]


def dice(a: np.ndarray, b: np.ndarray, k: int) -> float | None:
    x, y = a == k, b == k
    total = int(x.sum() + y.sum())
    return 2 * int((x & y).sum()) / total if total else None


def dice_rows(at: AppTest) -> dict[str, dict]:
    tables = [t.value for t in at.table if "Dice" in t.value.columns]
    assert len(tables) == 1, page_text(at)
    return {r["label"]: r for r in tables[0].to_dict("records")}


def check_dice(rows: dict[str, dict], a: np.ndarray, b: np.ndarray, labels: dict[int, str]) -> None:
    for k, name in labels.items():
        if k == 0:
            continue
        want = dice(a, b, k)
        assert rows[name]["Dice"] == ("both empty" if want is None else f"{want:.3f}"), rows[name]


def segmented(at: AppTest, path: Path) -> AppTest:
    at = upload_files(at, [(path.name, path.read_bytes())])
    at = run_model(at)
    assert not errors(at), errors(at)
    return at


def mask_uploader(at: AppTest):
    return next(u for u in at.file_uploader if u.key.startswith("mask_upload_"))


def test_existing_mask_beside_the_models(two_models, seg_run, case, monkeypatch, tmp_path: Path) -> None:
    bundle = load_bundle(seg_run.run_dir)
    at = segmented(new_app(two_models, monkeypatch), Path(case["image"]))
    at.radio(key="compare").set_value("A mask file").run()
    truth = Path(case["label"])
    mask_uploader(at).set_value([(truth.name, truth.read_bytes(), "application/gzip")])
    at.run()
    assert not errors(at), errors(at)
    model = predict(bundle, load_image(case["image"]), device="cpu").label[0].numpy()
    reference = np.asanyarray(nib.load(truth).dataobj)
    assert (model != reference).any()  # a real comparison, not a mask against itself
    check_dice(dice_rows(at), model, reference, bundle.labels)
    assert f"Shown in cyan beside tiny-seg's mask: {truth.name}" in page_text(at)

    # the same label map on a grid shifted by 5 mm: refused, in words a browser user can act on
    img = nib.load(truth)
    moved = img.affine.copy()
    moved[0, 3] += 5.0
    bad = tmp_path / "moved.nii.gz"
    nib.save(nib.Nifti1Image(np.asanyarray(img.dataobj), moved), bad)
    mask_uploader(at).set_value([(bad.name, bad.read_bytes(), "application/gzip")])
    at.run()
    (message,) = errors(at)
    assert "moved.nii.gz has this scan's size but lies elsewhere in the patient" in message
    assert "/" not in message.split("moved.nii.gz")[0]  # no folder paths


def test_two_models_side_by_side(two_models, seg_run, second_run, case, monkeypatch) -> None:
    at = segmented(new_app(two_models, monkeypatch), Path(case["image"]))
    at.radio(key="compare").set_value("Another model").run()
    assert [o for o in at.selectbox(key="second_model").options if o.startswith("tiny-seg-b")]
    (button,) = [b for b in at.button if b.key == "run_second"]
    at = button.click().run()
    assert not errors(at), errors(at)
    image = load_image(case["image"])
    first = predict(load_bundle(seg_run.run_dir), image, device="cpu").label[0].numpy()
    second = predict(load_bundle(second_run.run_dir), image, device="cpu").label[0].numpy()
    assert (first != second).any()
    rows = dice_rows(at)
    check_dice(rows, first, second, load_bundle(seg_run.run_dir).labels)
    # another model's mask gets its own viewer beside the first by default; edges on request
    assert "Shown in a second viewer to the right of tiny-seg's" in page_text(at)
    assert rows["organ"]["tiny-seg-b voxels"] == int((second == 1).sum())
    at.radio(key="second_view_model").set_value("As cyan edges on the model's view").run()
    assert "Shown in cyan beside tiny-seg's mask: tiny-seg-b" in page_text(at)
