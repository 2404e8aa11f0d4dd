"""nnU-Net v2 raw datasets read as they are (medseg.datasets.nnunet_layout through ``load_dataset``).

The reference is the Decathlon reader on the real Task04_Hippocampus: an nnU-Net folder of links to
the same files must give the same cases, labels and modality.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest

from medseg.cli.main import main
from medseg.datasets.decathlon import load_dataset
from medseg.errors import DataError

HIPPO = Path(__file__).resolve().parents[3] / "shared" / "data" / "Task04_Hippocampus"
needs_hippo = pytest.mark.skipif(
    not (HIPPO / "dataset.json").is_file(), reason=f"the real Task04_Hippocampus is not at {HIPPO}"
)
N_CASES = 10


def write_json(root: Path, data: dict[str, Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "dataset.json").write_text(json.dumps(data, indent=2))


def nnunet_json(n: int, **extra: Any) -> dict[str, Any]:
    """A dataset.json as nnU-Net v2 writes it for the hippocampus task."""
    return {
        "channel_names": {"0": "MRI"},
        "labels": {"background": 0, "Anterior": 1, "Posterior": 2},
        "numTraining": n,
        "file_ending": ".nii.gz",
        "name": "Hippocampus",
        **extra,
    }


def case_name(path: str) -> str:
    return Path(path).name.removesuffix(".nii.gz")


@pytest.fixture
def hippo_nnunet(tmp_path: Path) -> Path:
    """The first N_CASES hippocampus cases in nnU-Net's raw layout, as links to the real files."""
    root = tmp_path / "Dataset004_Hippocampus"
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    for item in sorted(load_dataset(HIPPO).training, key=lambda it: it["image"])[:N_CASES]:
        case = case_name(item["image"])
        os.symlink(item["image"], root / "imagesTr" / f"{case}_0000.nii.gz")
        os.symlink(item["label"], root / "labelsTr" / f"{case}.nii.gz")
    write_json(root, nnunet_json(N_CASES))
    return root


@needs_hippo
def test_hippocampus_in_nnunet_layout_reads_like_the_decathlon_original(hippo_nnunet: Path) -> None:
    ref = load_dataset(HIPPO)
    info = load_dataset(hippo_nnunet)
    pairs = sorted((os.path.realpath(it["image"]), os.path.realpath(it["label"])) for it in info.training)
    ref_pairs = sorted((os.path.realpath(it["image"]), os.path.realpath(it["label"])) for it in ref.training)
    assert len(pairs) == N_CASES and pairs == ref_pairs[:N_CASES]
    # the paths stay inside the nnU-Net folder, named as nnU-Net names them
    assert all(Path(it["image"]).parent == hippo_nnunet / "imagesTr" for it in info.training)
    assert [case_name(it["image"]) for it in info.training] == [
        case_name(it["label"]) + "_0000" for it in info.training
    ]
    assert info.labels == ref.labels == {0: "background", 1: "Anterior", 2: "Posterior"}
    assert info.modality == ref.modality == {"0": "MRI"}
    assert (info.task, info.name, info.num_training, info.test) == (
        "segmentation",
        "Hippocampus",
        N_CASES,
        [],
    )


@needs_hippo
def test_validate_accepts_the_nnunet_hippocampus(hippo_nnunet: Path, capsys) -> None:
    assert main(["data", "validate", str(hippo_nnunet)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"{N_CASES} cases, 0 problems" in out


SHAPE = (8, 8, 6)


def tiny_nnunet(root: Path, cases: int = 2, **extra: Any) -> Path:
    """A small synthetic single-channel nnU-Net dataset."""
    rng = np.random.default_rng(0)
    for i in range(cases):
        for folder, name, data in (
            ("imagesTr", f"case_{i:03d}_0000.nii.gz", rng.normal(size=SHAPE).astype(np.float32)),
            ("labelsTr", f"case_{i:03d}.nii.gz", (rng.random(SHAPE) > 0.5).astype(np.uint8)),
        ):
            (root / folder).mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(data, np.eye(4)), str(root / folder / name))
    write_json(root, nnunet_json(cases, **extra))
    return root


def test_missing_label_file_is_named(tmp_path: Path, capsys) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    (root / "labelsTr" / "case_001.nii.gz").unlink()
    with pytest.raises(
        DataError, match=r"case 'case_001' has images but no label file; expected labelsTr/case_001\.nii\.gz"
    ):
        load_dataset(root)
    assert main(["data", "validate", str(root)]) == 2
    assert "labelsTr/case_001.nii.gz" in capsys.readouterr().err


def test_region_based_label_is_refused(tmp_path: Path) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    write_json(root, nnunet_json(2, labels={"background": 0, "whole": [1, 2], "core": 2}))
    with pytest.raises(DataError, match=r"label 'whole' is region-based.*does not support"):
        load_dataset(root)


def test_ignore_label_is_refused(tmp_path: Path) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    write_json(root, nnunet_json(2, labels={"background": 0, "organ": 1, "ignore": 2}))
    with pytest.raises(DataError, match=r"label 'ignore'.*does not support"):
        load_dataset(root)


def test_missing_channel_file_is_named(tmp_path: Path) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    os.rename(root / "imagesTr" / "case_001_0000.nii.gz", root / "imagesTr" / "case_001_0001.nii.gz")
    with pytest.raises(DataError, match=r"imagesTr/case_001_0001\.nii\.gz is channel 1"):
        load_dataset(root)


def test_image_without_channel_suffix_is_named(tmp_path: Path) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    os.rename(root / "imagesTr" / "case_001_0000.nii.gz", root / "imagesTr" / "case_001.nii.gz")
    with pytest.raises(
        DataError, match=r"imagesTr/case_001\.nii\.gz is not an image file named <case>_<XXXX>"
    ):
        load_dataset(root)


def test_label_without_image_is_named(tmp_path: Path) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    (root / "imagesTr" / "case_001_0000.nii.gz").unlink()
    with pytest.raises(DataError, match=r"labelsTr/case_001\.nii\.gz is not the label of a case in imagesTr"):
        load_dataset(root)


def test_multi_channel_is_refused(tmp_path: Path) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    write_json(root, nnunet_json(2, channel_names={"0": "T2", "1": "ADC"}))
    with pytest.raises(DataError, match=r"declares 2 channels.*one channel only"):
        load_dataset(root)


def test_non_nifti_file_ending_is_refused(tmp_path: Path) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    write_json(root, nnunet_json(2, file_ending=".mha"))
    with pytest.raises(DataError, match=r"'file_ending' is '\.mha'; medseg reads NIfTI only"):
        load_dataset(root)


def test_explicit_dataset_mapping_and_test_images(tmp_path: Path) -> None:
    root = tiny_nnunet(tmp_path / "ds")
    (root / "imagesTs").mkdir()
    os.link(root / "imagesTr" / "case_000_0000.nii.gz", root / "imagesTs" / "new_007_0000.nii.gz")
    listed = {"b": {"images": ["imagesTr/case_001_0000.nii.gz"], "label": "labelsTr/case_001.nii.gz"}}
    write_json(root, nnunet_json(1, dataset=listed))
    info = load_dataset(root)
    root = root.resolve()
    assert info.training == [
        {
            "image": str(root / "imagesTr/case_001_0000.nii.gz"),
            "label": str(root / "labelsTr/case_001.nii.gz"),
        }
    ]
    assert info.test == [{"image": str(root / "imagesTs/new_007_0000.nii.gz")}]
