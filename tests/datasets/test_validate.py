"""Tests for Decathlon datalists (medseg.datasets.decathlon) and dataset validation (.validate)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest

from medseg.datasets.decathlon import DatasetInfo, load_dataset, split_train_val, write_dataset_json
from medseg.datasets.validate import ValidationReport, validate_dataset
from medseg.errors import ConfigError, DataError

SHAPE = (16, 16, 8)
# 0.8 x 0.8 x 2.5 mm voxels with the first axis flipped and an offset origin.
AFFINE = np.array(
    [
        [-0.8, 0.0, 0.0, 60.0],
        [0.0, 0.8, 0.0, -40.0],
        [0.0, 0.0, 2.5, 10.0],
        [0.0, 0.0, 0.0, 1.0],
    ]
)


def save(path: Path, data: np.ndarray, affine: np.ndarray = AFFINE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), str(path))


def make_image(seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).normal(100.0, 20.0, size=shape).astype(np.float32)


def make_label(shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    label = np.zeros(shape, dtype=np.uint8)
    label[4:12, 4:12, 2:6] = 1
    label[6:9, 6:9, 3:5] = 2
    return label


def read_json(root: Path) -> dict[str, Any]:
    return json.loads((root / "dataset.json").read_text())


def write_json(root: Path, data: dict[str, Any]) -> None:
    (root / "dataset.json").write_text(json.dumps(data, indent=2))


@pytest.fixture
def seg_dataset(tmp_path: Path) -> Path:
    """A valid 3-case segmentation dataset with one test image."""
    root = tmp_path / "seg"
    training = []
    for i in range(3):
        save(root / "imagesTr" / f"case_{i:03d}.nii.gz", make_image(i))
        save(root / "labelsTr" / f"case_{i:03d}.nii.gz", make_label())
        training.append(
            {"image": f"./imagesTr/case_{i:03d}.nii.gz", "label": f"./labelsTr/case_{i:03d}.nii.gz"}
        )
    save(root / "imagesTs" / "case_100.nii.gz", make_image(100))
    write_json(
        root,
        {
            "name": "toy-seg",
            "description": "synthetic",
            "modality": {"0": "CT"},
            "labels": {"0": "background", "1": "organ", "2": "lesion"},
            "numTraining": 3,
            "numTest": 1,
            "training": training,
            "test": ["./imagesTs/case_100.nii.gz"],
        },
    )
    return root


@pytest.fixture
def cls_dataset(tmp_path: Path) -> Path:
    """A valid 4-case classification dataset."""
    root = tmp_path / "cls"
    training = []
    for i in range(4):
        save(root / "imagesTr" / f"obj_{i}.nii.gz", make_image(i))
        training.append({"image": f"./imagesTr/obj_{i}.nii.gz", "label": i % 2})
    write_json(
        root,
        {
            "name": "toy-cls",
            "task": "classification",
            "modality": {"0": "MR"},
            "labels": {"0": "sphere", "1": "cube"},
            "numTraining": 4,
            "numTest": 0,
            "training": training,
            "test": [],
        },
    )
    return root


def only_problem(report: ValidationReport) -> str:
    assert not report.ok
    assert len(report.problems) == 1, report.problems
    return report.problems[0]


def row(report: ValidationReport, case: str):
    (match,) = [r for r in report.rows if r.case == case]
    return match


# --- load_dataset / write_dataset_json ---------------------------------------------------------------


def test_load_dataset_resolves_paths(seg_dataset: Path) -> None:
    info = load_dataset(seg_dataset)
    assert isinstance(info, DatasetInfo)
    assert info.task == "segmentation"
    assert info.name == "toy-seg"
    assert info.labels == {0: "background", 1: "organ", 2: "lesion"}
    assert info.modality == {"0": "CT"}
    assert len(info.training) == 3 and len(info.test) == 1
    first = info.training[0]
    assert Path(first["image"]).is_absolute() and Path(first["image"]).is_file()
    assert first["image"] == str(seg_dataset.resolve() / "imagesTr" / "case_000.nii.gz")
    assert first["label"] == str(seg_dataset.resolve() / "labelsTr" / "case_000.nii.gz")
    assert info.test[0]["image"] == str(seg_dataset.resolve() / "imagesTs" / "case_100.nii.gz")


def test_load_dataset_test_items_as_dicts(seg_dataset: Path) -> None:
    data = read_json(seg_dataset)
    data["test"] = [{"image": "./imagesTs/case_100.nii.gz"}]
    write_json(seg_dataset, data)
    assert load_dataset(seg_dataset).test[0]["image"].endswith("imagesTs/case_100.nii.gz")


def test_load_classification_keeps_int_labels(cls_dataset: Path) -> None:
    info = load_dataset(cls_dataset)
    assert info.task == "classification"
    assert [it["label"] for it in info.training] == [0, 1, 0, 1]
    assert Path(info.training[0]["image"]).is_file()


def test_missing_dataset_json_raises(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"not a dataset folder: no dataset\.json.*synth-seg"):
        load_dataset(tmp_path)
    with pytest.raises(DataError, match="not a dataset folder"):
        validate_dataset(tmp_path / "nowhere")


def test_invalid_json_raises_with_line(seg_dataset: Path) -> None:
    (seg_dataset / "dataset.json").write_text('{\n  "name": "x",\n  "labels": {"0": "bg"},,\n}\n')
    with pytest.raises(DataError, match=r"dataset\.json.*invalid JSON at line 3") as exc:
        validate_dataset(seg_dataset)
    assert str((seg_dataset / "dataset.json").resolve()) in str(exc.value)


def test_missing_training_key_raises(seg_dataset: Path) -> None:
    data = read_json(seg_dataset)
    del data["training"]
    write_json(seg_dataset, data)
    with pytest.raises(DataError, match="'training' is missing"):
        validate_dataset(seg_dataset)


def test_wrong_type_key_raises(seg_dataset: Path) -> None:
    data = read_json(seg_dataset)
    data["labels"] = ["background", "organ"]
    write_json(seg_dataset, data)
    with pytest.raises(DataError, match="'labels' must be"):
        load_dataset(seg_dataset)


def test_classification_label_must_be_int(cls_dataset: Path) -> None:
    data = read_json(cls_dataset)
    data["training"][2]["label"] = "cube"
    write_json(cls_dataset, data)
    with pytest.raises(DataError, match=r"training\[2\]\.label"):
        load_dataset(cls_dataset)


def test_write_dataset_json_roundtrip(tmp_path: Path) -> None:
    root = tmp_path / "new"
    content = {
        "name": "w",
        "labels": {"0": "background", "1": "organ"},
        "numTraining": 1,
        "training": [{"image": "./imagesTr/a.nii.gz", "label": "./labelsTr/a.nii.gz"}],
        "test": [],
    }
    path = write_dataset_json(root, content)
    assert path == root / "dataset.json"
    assert json.loads(path.read_text()) == content
    assert "\n  " in path.read_text()  # pretty-printed
    assert sorted(p.name for p in root.iterdir()) == ["dataset.json"]  # no temp file left behind
    content["name"] = "w2"
    write_dataset_json(root, content)
    assert load_dataset(root).name == "w2"


# --- split_train_val ---------------------------------------------------------------------------------


def test_split_train_val_deterministic() -> None:
    items = [f"case_{i}" for i in range(20)]
    train, val = split_train_val(items, 0.25, seed=7)
    assert (train, val) == split_train_val(items, 0.25, seed=7)
    assert len(val) == 5 and len(train) == 15
    assert sorted(train + val) == sorted(items) and not set(train) & set(val)
    others = {tuple(split_train_val(items, 0.25, seed=s)[1]) for s in range(5)}
    assert len(others) > 1  # the seed matters


def test_split_train_val_small_lists() -> None:
    train, val = split_train_val(["a", "b"], 0.1, seed=0)
    assert len(val) == 1 and len(train) == 1
    assert split_train_val(["a"], 0.5, seed=0) == (["a"], [])
    assert split_train_val(["a", "b", "c"], 0.0, seed=0) == (["a", "b", "c"], [])
    with pytest.raises(ConfigError, match="val_fraction"):
        split_train_val(["a", "b"], 1.0, seed=0)


# --- validate_dataset: valid datasets ----------------------------------------------------------------


def test_valid_segmentation_dataset(seg_dataset: Path) -> None:
    report = validate_dataset(seg_dataset)
    assert report.ok and report.problems == []
    assert [r.case for r in report.rows] == [
        "case_000.nii.gz",
        "case_001.nii.gz",
        "case_002.nii.gz",
        "case_100.nii.gz",
    ]
    first = report.rows[0]
    assert first.shape == SHAPE
    assert first.spacing == (0.8, 0.8, 2.5)
    assert first.labels == "0,1,2"
    assert all(r.status == "ok" for r in report.rows)
    table = report.format_table()
    lines = table.splitlines()
    assert lines[0].split() == ["case", "split", "shape", "spacing", "labels", "status"]
    assert any("case_001.nii.gz" in ln and "16x16x8" in ln and "0.80x0.80x2.50" in ln for ln in lines)
    assert lines[-1] == "4 cases, 0 problems"
    # fixed-width: the status column starts at the same offset on every case line
    offsets = {ln.rindex(" ok") for ln in lines[2:6]}
    assert len(offsets) == 1


def test_valid_classification_dataset(cls_dataset: Path) -> None:
    report = validate_dataset(cls_dataset)
    assert report.ok, report.problems
    assert [r.labels for r in report.rows] == ["0 (sphere)", "1 (cube)", "0 (sphere)", "1 (cube)"]
    assert "class" in report.format_table().splitlines()[0]


def test_four_d_single_channel_is_ok(seg_dataset: Path) -> None:
    save(seg_dataset / "imagesTr" / "case_001.nii.gz", make_image(1)[..., None])
    report = validate_dataset(seg_dataset)
    assert report.ok, report.problems
    assert row(report, "case_001.nii.gz").shape == (*SHAPE, 1)


def test_many_cases_with_progress_bar(tmp_path: Path) -> None:
    root = tmp_path / "many"
    training = []
    for i in range(12):
        save(root / "imagesTr" / f"c{i:02d}.nii.gz", make_image(i, (8, 8, 4)))
        save(root / "labelsTr" / f"c{i:02d}.nii.gz", make_label((8, 8, 4)))
        training.append({"image": f"imagesTr/c{i:02d}.nii.gz", "label": f"labelsTr/c{i:02d}.nii.gz"})
    write_dataset_json(
        root, {"labels": {"0": "bg", "1": "a", "2": "b"}, "numTraining": 12, "training": training}
    )
    report = validate_dataset(root)
    assert report.ok, report.problems
    assert len(report.rows) == 12


# --- validate_dataset: one test per defect -----------------------------------------------------------


def test_missing_image_file(seg_dataset: Path) -> None:
    (seg_dataset / "imagesTr" / "case_001.nii.gz").unlink()
    report = validate_dataset(seg_dataset)
    problem = only_problem(report)
    assert "imagesTr/case_001.nii.gz" in problem and "not found" in problem
    assert row(report, "case_001.nii.gz").status == "FAIL"
    assert row(report, "case_000.nii.gz").status == "ok"


def test_truncated_gzip_image(seg_dataset: Path) -> None:
    path = seg_dataset / "imagesTr" / "case_002.nii.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    report = validate_dataset(seg_dataset)
    problem = only_problem(report)
    assert "imagesTr/case_002.nii.gz" in problem
    assert "cannot be read" in problem and "truncated" in problem
    assert row(report, "case_002.nii.gz").status == "FAIL"


def test_truncated_label_header(seg_dataset: Path) -> None:
    path = seg_dataset / "labelsTr" / "case_000.nii.gz"
    path.write_bytes(path.read_bytes()[:40])
    problem = only_problem(validate_dataset(seg_dataset))
    assert "labelsTr/case_000.nii.gz" in problem and "cannot be read" in problem


def test_label_shape_mismatch(seg_dataset: Path) -> None:
    save(seg_dataset / "labelsTr" / "case_001.nii.gz", make_label((16, 16, 7)))
    problem = only_problem(validate_dataset(seg_dataset))
    assert "labelsTr/case_001.nii.gz" in problem
    assert "shape (16, 16, 7)" in problem and "(16, 16, 8)" in problem


def test_label_affine_mismatch(seg_dataset: Path) -> None:
    shifted = AFFINE.copy()
    shifted[0, 3] += 2.5
    save(seg_dataset / "labelsTr" / "case_000.nii.gz", make_label(), affine=shifted)
    problem = only_problem(validate_dataset(seg_dataset))
    assert "labelsTr/case_000.nii.gz" in problem
    assert "affine" in problem and "max abs difference 2.5" in problem


def test_label_affine_within_tolerance_is_ok(seg_dataset: Path) -> None:
    nudged = AFFINE.copy()
    nudged[1, 3] += 1e-5
    save(seg_dataset / "labelsTr" / "case_000.nii.gz", make_label(), affine=nudged)
    assert validate_dataset(seg_dataset).ok


def test_label_values_outside_declared(seg_dataset: Path) -> None:
    label = make_label()
    label[0, 0, 0] = 3
    label[1, 0, 0] = 7
    save(seg_dataset / "labelsTr" / "case_002.nii.gz", label)
    report = validate_dataset(seg_dataset)
    problem = only_problem(report)
    assert "labelsTr/case_002.nii.gz" in problem
    assert "3, 7" in problem and "not declared" in problem
    assert row(report, "case_002.nii.gz").labels == "0,1,2,3,7"


def test_non_integer_label_values(seg_dataset: Path) -> None:
    label = make_label().astype(np.float32)
    label[0, 0, 0] = 0.5
    save(seg_dataset / "labelsTr" / "case_001.nii.gz", label)
    problem = only_problem(validate_dataset(seg_dataset))
    assert "labelsTr/case_001.nii.gz" in problem and "integers" in problem and "0.5" in problem


def test_nan_in_image(seg_dataset: Path) -> None:
    image = make_image(0)
    image[3, 4, 5] = np.nan
    image[3, 4, 6] = np.nan
    save(seg_dataset / "imagesTr" / "case_000.nii.gz", image)
    problem = only_problem(validate_dataset(seg_dataset))
    assert "imagesTr/case_000.nii.gz" in problem and "2 NaN" in problem


def test_inf_in_image(seg_dataset: Path) -> None:
    image = make_image(1)
    image[0, 0, 0] = np.inf
    save(seg_dataset / "imagesTr" / "case_001.nii.gz", image)
    problem = only_problem(validate_dataset(seg_dataset))
    assert "imagesTr/case_001.nii.gz" in problem and "1 Inf" in problem


def test_nan_in_test_image(seg_dataset: Path) -> None:
    image = make_image(100)
    image[1, 1, 1] = np.nan
    save(seg_dataset / "imagesTs" / "case_100.nii.gz", image)
    report = validate_dataset(seg_dataset)
    problem = only_problem(report)
    assert "imagesTs/case_100.nii.gz" in problem and "NaN" in problem
    assert row(report, "case_100.nii.gz").split == "test"


def test_two_d_image(cls_dataset: Path) -> None:
    save(cls_dataset / "imagesTr" / "obj_1.nii.gz", make_image(1, (16, 16)))
    report = validate_dataset(cls_dataset)
    problem = only_problem(report)
    assert "imagesTr/obj_1.nii.gz" in problem and "2D" in problem and "3D" in problem
    assert row(report, "obj_1.nii.gz").status == "FAIL"


def test_four_d_multi_channel_image(cls_dataset: Path) -> None:
    save(cls_dataset / "imagesTr" / "obj_0.nii.gz", make_image(0, (*SHAPE, 3)))
    problem = only_problem(validate_dataset(cls_dataset))
    assert "imagesTr/obj_0.nii.gz" in problem and "4D with 3 channels" in problem


def test_num_training_mismatch(seg_dataset: Path) -> None:
    data = read_json(seg_dataset)
    data["numTraining"] = 5
    write_json(seg_dataset, data)
    report = validate_dataset(seg_dataset)
    problem = only_problem(report)
    assert "dataset.json" in problem and "numTraining is 5" in problem and "lists 3" in problem
    assert all(r.status == "ok" for r in report.rows)
    assert report.format_table().splitlines()[-1] == "4 cases, 1 problems"


def test_classification_label_not_a_class(cls_dataset: Path) -> None:
    data = read_json(cls_dataset)
    data["training"][3]["label"] = 4
    write_json(cls_dataset, data)
    report = validate_dataset(cls_dataset)
    problem = only_problem(report)
    assert "imagesTr/obj_3.nii.gz" in problem and "class label 4" in problem and "0=sphere" in problem
    assert row(report, "obj_3.nii.gz").status == "FAIL"


def test_several_problems_all_listed(seg_dataset: Path) -> None:
    (seg_dataset / "labelsTr" / "case_000.nii.gz").unlink()
    save(seg_dataset / "labelsTr" / "case_002.nii.gz", make_label((8, 8, 8)))
    report = validate_dataset(seg_dataset)
    assert len(report.problems) == 2
    table = report.format_table()
    assert "labelsTr/case_000.nii.gz: file not found" in table
    assert "labelsTr/case_002.nii.gz: label shape" in table
    assert table.splitlines()[-1] == "4 cases, 2 problems"
    assert [r.status for r in report.rows] == ["FAIL", "ok", "FAIL", "ok"]
