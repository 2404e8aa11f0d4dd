"""What leaves a site in a bundle: no case file names and no dataset path unless ``data.share_paths``.

Every file of a bundle (JSON, README and the weights' bytes) is searched for the dataset's absolute
path and for the file name (and stem) of every case the dataset holds: none by default, and with
``data.share_paths: true`` the path and the validation cases' names are found, so the search is
seen to work. ``medseg evaluate``'s per-case ``eval-*.json`` stays beside the bundle, never in it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from medseg.apps.registry import read_info
from medseg.bundle.export import WITHHELD, export_bundle
from medseg.checkpoint import load_checkpoint
from medseg.config import load_config
from medseg.datasets.decathlon import load_dataset, split_train_val
from medseg.errors import DataError
from medseg.inference.evaluate import evaluate

NIFTI = (".nii.gz", ".nii")


def _stem(name: str) -> str:
    return next((name[: -len(s)] for s in NIFTI if name.endswith(s)), name)


def case_names(data_dir: Path) -> list[str]:
    """Every image and label file name of the dataset (training and test), and their stems."""
    info = load_dataset(data_dir)
    paths = [i["image"] for i in info.training + info.test]
    paths += [i["label"] for i in info.training if isinstance(i["label"], str)]
    names = {Path(p).name for p in paths}
    return sorted(names | {_stem(n) for n in names})


def found(bundle: Path, needles: list[str]) -> dict[str, list[str]]:
    """{needle: bundle files holding it}, over every file's bytes."""
    hits: dict[str, list[str]] = {}
    files = [p for p in sorted(bundle.rglob("*")) if p.is_file()]
    assert len(files) >= 5, files  # metadata, inference, medseg.json, model.pt, README
    for path in files:
        data = path.read_bytes()
        for needle in needles:
            if needle.encode() in data:
                hits.setdefault(needle, []).append(str(path.relative_to(bundle)))
    return hits


def _paths(data_dir: Path) -> list[str]:
    return sorted({str(data_dir), str(data_dir.resolve())})


def _val_names(data_dir: Path, run_dir: Path) -> list[str]:
    cfg = load_config(run_dir / "config.yaml")
    _, val = split_train_val(load_dataset(data_dir).training, cfg.data.val_fraction, cfg.train.seed)
    return [Path(i["image"]).name for i in val]


def test_trained_bundle_names_no_case_and_no_data_path(seg_run, seg_data: Path) -> None:
    bundle = seg_run.run_dir / "bundle"
    assert found(bundle, _paths(seg_data) + case_names(seg_data)) == {}
    # what is said instead: the dataset's name, its folder's base name and counts
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    val = meta["validated_on"]
    assert val["dataset_dir"] == meta["data_source"] == seg_data.name
    assert val["num_validation_cases"] == len(val["cases"]) == 2 and set(val["cases"]) == {WITHHELD}
    assert val["num_training_cases"] == 6 and val["dataset_name"]
    settings = json.loads((bundle / "configs" / "medseg.json").read_text())
    assert settings["data"]["dir"] == seg_data.name and settings["data"]["share_paths"] is False
    assert "/" not in settings["runs_dir"]
    readme = (bundle / "docs" / "README.md").read_text()
    assert "2 held-out cases" in readme and "file names are not part of the bundle" in readme
    # the viewer still lists the model with its dataset's name and case counts
    info = read_info(bundle)
    assert (info.n_val, info.n_train, info.dataset_name) == (2, 6, val["dataset_name"])


@pytest.mark.parametrize("share", [False, True])
def test_share_paths_opts_in_to_names_and_paths(seg_run, seg_data: Path, tmp_path: Path, share: bool) -> None:
    cfg = load_config(seg_run.run_dir / "config.yaml")
    cfg.runs_dir, cfg.name, cfg.data.share_paths = str(tmp_path), f"share-{share}", share
    state = load_checkpoint(seg_run.run_dir / "checkpoints" / "best.pt")
    bundle = export_bundle(cfg, state, metrics={"val_dice": 0.5})
    hits = found(bundle, _paths(seg_data) + case_names(seg_data))
    if not share:
        assert hits == {}
        return
    val_names = _val_names(seg_data, seg_run.run_dir)
    assert str(seg_data) in hits and set(val_names) <= set(hits), hits
    assert "configs/medseg.json" in hits[str(seg_data)] and "docs/README.md" in hits[val_names[0]]
    assert (
        json.loads((bundle / "configs" / "metadata.json").read_text())["validated_on"]["cases"] == val_names
    )


def test_evaluate_keeps_case_rows_beside_the_bundle(seg_run, seg_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(seg_run.run_dir / "bundle", run / "bundle")
    before = {p: p.read_bytes() for p in (run / "bundle").rglob("*") if p.is_file()}
    # without the run's config.yaml the bundle's base name is not a folder here: a clear error
    with pytest.raises(DataError, match="--data DIR"):
        evaluate(run, progress=False)
    shutil.copy(seg_run.run_dir / "config.yaml", run / "config.yaml")
    result = evaluate(run, progress=False)  # the validation split, found through config.yaml
    written = json.loads((run / "eval-val.json").read_text())
    assert [r["case"] for r in written["cases"]] == _val_names(seg_data, seg_run.run_dir)
    assert result["path"] == str(run / "eval-val.json")
    after = {p: p.read_bytes() for p in (run / "bundle").rglob("*") if p.is_file()}
    assert after == before
    assert found(run / "bundle", _paths(seg_data) + case_names(seg_data)) == {}
