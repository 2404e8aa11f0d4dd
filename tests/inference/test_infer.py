"""Inference, evaluation and bundles: predictions land on the input's own grid and affine."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser

from medseg.bundle.load import load_bundle
from medseg.cli.main import main
from medseg.config import config_from_dict
from medseg.datasets.decathlon import load_dataset
from medseg.datasets.dicom.write import write_dicom_series
from medseg.datasets.nifti import save_nifti
from medseg.inference.evaluate import evaluate
from medseg.inference.io import load_image
from medseg.inference.predict import label_volumes, predict
from medseg.training.loop import train
from tests.geometry import dicom_series_geometry, oblique

ANATOMICAL = Path(nib.__file__).parent / "tests" / "data" / "anatomical.nii"


def _test_case(seg_data: Path) -> nib.Nifti1Image:
    return nib.load(load_dataset(seg_data).test[0]["image"])


@pytest.mark.parametrize("turned", [False, True], ids=["lps", "oblique"])
def test_infer_on_dicom_series_keeps_series_geometry(
    seg_run, seg_data: Path, tmp_path: Path, turned: bool
) -> None:
    img = _test_case(seg_data)
    affine = oblique(img.affine) if turned else img.affine
    series = tmp_path / "series"
    write_dicom_series(np.asarray(img.dataobj), affine, series)
    out = tmp_path / "mask.nii.gz"
    assert main(["infer", "--run", str(seg_run.run_dir), "--input", str(series), "--output", str(out)]) == 0
    expected_affine, expected_shape = dicom_series_geometry(series)
    mask = nib.load(out)
    assert mask.shape == expected_shape
    np.testing.assert_allclose(mask.affine, expected_affine, atol=1e-3)
    values = set(np.unique(np.asarray(mask.dataobj)).tolist())
    assert values <= {0, 1, 2} and len(values) > 1


def test_convert_keeps_series_geometry(seg_data: Path, tmp_path: Path) -> None:
    img = _test_case(seg_data)
    series = tmp_path / "series"
    write_dicom_series(np.asarray(img.dataobj), oblique(img.affine, (0.0, 25.0, -10.0)), series)
    out = tmp_path / "ct.nii.gz"
    assert main(["data", "convert", str(series), str(out)]) == 0
    expected_affine, expected_shape = dicom_series_geometry(series)
    converted = nib.load(out)
    assert converted.shape == expected_shape
    np.testing.assert_allclose(converted.affine, expected_affine, atol=1e-3)


def test_nifti_round_trip_under_oblique_anisotropic_geometry(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(-1000, 1000, size=(20, 14, 9)).astype(np.int16)
    affine = oblique(
        np.diag([-0.7, 0.9, 3.0, 1.0])
        + np.array([[0, 0, 0, 40.0], [0, 0, 0, -12.5], [0, 0, 0, 7.0], [0, 0, 0, 0]])
    )
    path = save_nifti(data, affine, tmp_path / "x.nii.gz")
    image = load_image(path)
    assert tuple(image.shape) == (1, 20, 14, 9)
    np.testing.assert_allclose(np.asarray(image.affine), affine, atol=1e-4)
    np.testing.assert_array_equal(image[0].numpy(), data)


def test_predict_on_nibabel_anatomical(seg_run) -> None:
    """A real MR volume (33x41x25, 2 mm) goes through and comes back on its own grid."""
    bundle = load_bundle(seg_run.run_dir)
    image = load_image(ANATOMICAL)
    reference = nib.load(ANATOMICAL)
    np.testing.assert_allclose(np.asarray(image.affine), reference.affine, atol=1e-4)
    seen = []
    label = predict(bundle, image, progress=seen.append).label
    assert tuple(label.shape) == (1, *reference.shape)
    np.testing.assert_allclose(np.asarray(label.affine), reference.affine, atol=1e-4)
    assert seen[-1] == 1.0
    rows = label_volumes(label, bundle.labels)
    assert [r["label"] for r in rows] == ["organ", "lesion"]
    voxel_ml = abs(np.linalg.det(reference.affine[:3, :3])) / 1000
    assert rows[0]["ml"] == pytest.approx(rows[0]["voxels"] * voxel_ml)


def test_bundle_layout_and_weights_only_load(seg_run) -> None:
    root = seg_run.run_dir / "bundle"
    meta = json.loads((root / "configs" / "metadata.json").read_text())
    required = {
        "version",
        "changelog",
        "monai_version",
        "pytorch_version",
        "numpy_version",
        "optional_packages_version",
    }
    required |= {"task", "description", "authors", "copyright", "network_data_format", "schema"}
    assert required <= set(meta)
    assert meta["network_data_format"]["outputs"]["pred"]["num_channels"] == 3
    weights = torch.load(root / "models" / "model.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in weights.values())
    parser = ConfigParser()
    parser.read_config(root / "configs" / "inference.json")
    net = parser.get_parsed_content("network_def")
    net.load_state_dict(weights)
    assert (root / "docs" / "README.md").read_text().startswith("# tiny-seg")


def test_evaluate_scores_in_original_geometry(seg_run, seg_data: Path) -> None:
    result = evaluate(seg_run.run_dir, seg_data, progress=False)
    assert len(result["cases"]) == 8
    assert 0.0 <= result["summary"]["dice"] <= 1.0
    assert {"dice_organ", "dice_lesion", "hd95_organ", "hd95_lesion"} <= set(result["summary"])
    assert Path(result["path"]).is_file()


def test_classification_train_infer_evaluate(cls_data: Path, tmp_path: Path) -> None:
    cfg = config_from_dict(
        {
            "name": "tiny-cls",
            "task": "classification",
            "runs_dir": str(tmp_path),
            "data": {"dir": str(cls_data), "val_fraction": 0.25},
            "transforms": {"spacing": [1.0, 1.0, 1.0], "window": [-100, 200], "patch": [24, 24, 24]},
            "model": {"name": "resnet", "depth": 10, "norm": "batch"},
            "train": {"epochs": 2, "batch_size": 4, "seed": 0, "threads": 2},
        }
    )
    run = train(cfg, progress=False)
    assert run.key_metric == "val_auc"
    out = tmp_path / "p.json"
    test_image = load_dataset(cls_data).test[0]["image"]
    assert main(["infer", "--run", str(run.run_dir), "--input", test_image, "--output", str(out)]) == 0
    probs = json.loads(out.read_text())["probabilities"]
    assert set(probs) == {"sphere", "cube"} and sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
    result = evaluate(run.run_dir, progress=False)
    assert 0.0 <= result["summary"]["auc"] <= 1.0


def test_infer_keeps_the_inputs_sform_and_qform_codes(seg_run, seg_data: Path, tmp_path: Path) -> None:
    """A scan aligned to another (sform code 2, no qform) gets a mask that says the same, not code 1."""
    src = nib.load(sorted((seg_data / "imagesTr").glob("*.nii.gz"))[0])
    img = nib.Nifti1Image(np.asanyarray(src.dataobj), src.affine)
    img.set_sform(src.affine, code=2)
    img.set_qform(src.affine, code=0)
    scan = tmp_path / "aligned.nii.gz"
    nib.save(img, scan)
    out = tmp_path / "mask.nii.gz"
    assert main(["infer", "--run", str(seg_run.run_dir), "--input", str(scan), "--output", str(out)]) == 0
    header = nib.load(out).header
    assert (int(header["sform_code"]), int(header["qform_code"])) == (2, 0)
    assert np.allclose(nib.load(out).affine, src.affine, atol=1e-4)
