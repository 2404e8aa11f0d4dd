"""Training loop: learning happens, runs resume exactly, runs are not clobbered."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from medseg.checkpoint import load_checkpoint
from medseg.config import config_from_dict
from medseg.errors import ConfigError, RunError
from medseg.training.loop import train
from medseg.training.runlog import read_metrics
from tests.conftest import tiny_seg_config


def test_short_run_dice_rises_and_writes_run_folder(seg_run) -> None:
    records = read_metrics(seg_run.run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in records] == list(range(1, 9))
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert max(r["val_dice"] for r in records) > records[0]["val_dice"] + 0.15
    for name in (
        "config.yaml",
        "learning_curve.png",
        "train.log",
        "checkpoints/last.pt",
        "checkpoints/best.pt",
    ):
        assert (seg_run.run_dir / name).is_file(), name
    ckpt = load_checkpoint(seg_run.run_dir / "checkpoints" / "last.pt")
    assert ckpt["epoch"] == 8 and {"model", "optimizer", "rng", "config", "labels"} <= set(ckpt)


def test_resume_repeats_the_uninterrupted_run(seg_data: Path, tmp_path: Path) -> None:
    whole = train(tiny_seg_config(seg_data, tmp_path, name="whole", epochs=4), progress=False)
    cfg = tiny_seg_config(seg_data, tmp_path, name="sliced", epochs=4)
    part = train(cfg, progress=False, until_epoch=2)
    assert part.epochs == 2 and not (part.run_dir / "bundle").exists()
    train(cfg, resume=True, progress=False)

    a, b = read_metrics(whole.run_dir / "metrics.jsonl"), read_metrics(part.run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-6)
        assert rb["val_dice"] == pytest.approx(ra["val_dice"], rel=1e-6)
    wa = load_checkpoint(whole.run_dir / "checkpoints" / "last.pt")["model"]
    wb = load_checkpoint(part.run_dir / "checkpoints" / "last.pt")["model"]
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-6, atol=1e-7)
    assert (part.run_dir / "bundle" / "models" / "model.pt").is_file()


def test_until_epoch_in_the_config_stops_there_on_the_whole_runs_schedule(
    seg_data: Path, tmp_path: Path
) -> None:
    cfg = tiny_seg_config(seg_data, tmp_path, name="first", epochs=4)
    cfg.train.until_epoch = 2
    part = train(cfg, progress=False)
    assert part.epochs == 2 and not (part.run_dir / "bundle").exists()
    # the cosine schedule still spans the 4 epochs: after 2 of them lr is half the base, not 0
    lr = [r["lr"] for r in read_metrics(part.run_dir / "metrics.jsonl")]
    assert lr[-1] == pytest.approx(cfg.train.lr * 0.5, rel=1e-6), lr
    cfg.train.until_epoch = 5
    with pytest.raises(ConfigError, match="until_epoch"):
        config_from_dict(cfg.to_dict())


class _Killed(Exception):
    """The chief dying in the middle of its end-of-epoch writes."""


@pytest.mark.parametrize("dies", ["before", "after"])
def test_a_chief_killed_around_its_checkpoint_write_loses_no_epoch_record(
    seg_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dies: str
) -> None:
    """Killed just before or just after epoch 2's last.pt is written, the resumed run's metrics.jsonl
    still holds epochs 1, 2, 3 in order (CI once saw [1, 2, 4, ...] when the kill fell between the
    checkpoint and the metrics write)."""
    import medseg.training.loop as loop

    real = loop.save_checkpoints

    def dying_save(payload, paths, best):  # noqa: ANN001, ANN202
        if payload["epoch"] == 2 and dies == "before":
            raise _Killed
        real(payload, paths, best)
        if payload["epoch"] == 2:
            raise _Killed

    cfg = tiny_seg_config(seg_data, tmp_path, name=f"killed-{dies}", epochs=3)
    monkeypatch.setattr(loop, "save_checkpoints", dying_save)
    with pytest.raises(_Killed):
        train(cfg, progress=False)
    monkeypatch.setattr(loop, "save_checkpoints", real)
    train(cfg, resume=True, progress=False)
    assert [r["epoch"] for r in read_metrics(cfg.run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_stop_at_ends_training_once_the_metric_is_reached_after_min_epochs(
    seg_data: Path, tmp_path: Path
) -> None:
    # any Dice above 0 reaches the target at epoch 1, but not before min_epochs = 2
    result = train(
        tiny_seg_config(seg_data, tmp_path, name="early", epochs=6, stop_at=1e-6, min_epochs=2),
        progress=False,
    )
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [1, 2] and result.epochs == 2
    assert (
        result.run_dir / "bundle" / "models" / "model.pt"
    ).is_file()  # a finished run, not an interrupted one
    # a target never reached trains every epoch
    result = train(tiny_seg_config(seg_data, tmp_path, name="never", epochs=2, stop_at=1.01), progress=False)
    assert [r["epoch"] for r in read_metrics(result.run_dir / "metrics.jsonl")] == [1, 2]


def test_existing_run_is_not_overwritten(seg_run) -> None:
    cfg_dict = load_checkpoint(seg_run.run_dir / "checkpoints" / "last.pt")["config"]
    from medseg.config import config_from_dict

    cfg = config_from_dict(cfg_dict)
    with pytest.raises(RunError, match="already holds a run"):
        train(cfg, progress=False)
    with pytest.raises(RunError, match="already finished"):
        train(cfg, resume=True, progress=False)
    changed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=0.1, epochs=9))
    with pytest.raises(ConfigError, match="changed keys: train.lr"):
        train(changed, resume=True, progress=False)


def test_resume_without_checkpoint_is_a_clear_error(seg_data: Path, tmp_path: Path) -> None:
    with pytest.raises(RunError, match="nothing to resume"):
        train(tiny_seg_config(seg_data, tmp_path, name="never"), resume=True, progress=False)


def test_disk_cache_keeps_geometry_and_trains(seg_data: Path, tmp_path: Path) -> None:
    cfg = tiny_seg_config(seg_data, tmp_path, name="disk", epochs=1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache="disk"))
    result = train(cfg, progress=False)
    cached = list((result.run_dir / "cache" / "train").glob("*.pt"))
    assert len(cached) == 6  # 8 cases, 2 held for validation
    from monai.data import MetaTensor

    item = torch.load(cached[0], weights_only=False)
    assert isinstance(item["image"], MetaTensor) and item["image"].affine.shape == (4, 4)


def test_a_filled_disk_cache_is_the_one_training_reads(seg_data: Path, tmp_path: Path) -> None:
    from medseg.training.data import fill_disk_cache

    cfg = tiny_seg_config(seg_data, tmp_path, name="shared", epochs=1)
    shared = tmp_path / "shared-cache"
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache="disk", cache_dir=str(shared)))
    fill_disk_cache(cfg)
    filled = {p: p.stat().st_mtime_ns for p in shared.rglob("*.pt")}
    assert len(filled) == 8  # 6 training and 2 validation cases
    train(cfg, progress=False)
    # training found every case in the cache: no file added, none written again
    assert {p: p.stat().st_mtime_ns for p in shared.rglob("*.pt")} == filled


def test_label_shape_mismatch_stops_training_before_it_starts(seg_data: Path, tmp_path: Path) -> None:
    import shutil

    import nibabel as nib
    import numpy as np

    from medseg.datasets.nifti import save_nifti
    from medseg.errors import DataError

    bad = tmp_path / "bad"
    shutil.copytree(seg_data, bad)
    label = sorted((bad / "labelsTr").iterdir())[2]
    img = nib.load(label)
    save_nifti(np.asarray(img.dataobj)[:-2], img.affine, label)
    with pytest.raises(DataError, match=f"{label.name}: label shape"):
        train(tiny_seg_config(bad, tmp_path, name="bad"), progress=False)
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_an_equal_key_metric_is_decided_by_the_tie_break_metric() -> None:
    """Two epochs of equal AUC 1.0 (accuracy 0.47, then 1.0): AUC alone cannot tell them apart, so the
    tie-break metric (accuracy) decides and the later epoch is the best."""
    from medseg.training.tasks import ClassificationTask, SegmentationTask, improves

    key, tie = ClassificationTask.key_metric, ClassificationTask.tie_metric
    e11 = {"val_auc": 1.0, "val_accuracy": 0.46875}
    e13 = {"val_auc": 1.0, "val_accuracy": 1.0}
    assert improves(e11, None, key, tie)
    assert improves(e13, e11, key, tie)
    assert not improves(e11, e13, key, tie)
    assert not improves(dict(e13), e13, key, tie)  # an equal epoch does not replace the earlier one
    assert improves({"val_auc": 0.9}, {"val_auc": 0.8, "val_accuracy": 1.0}, key, tie)
    assert not improves({"val_auc": None}, None, key, tie)
    assert not improves(
        {"val_dice": 0.5}, {"val_dice": 0.5}, SegmentationTask.key_metric, SegmentationTask.tie_metric
    )


def test_best_checkpoint_is_the_epoch_with_the_highest_auc_then_accuracy(cls_run) -> None:
    records = read_metrics(cls_run.run_dir / "metrics.jsonl")
    state = load_checkpoint(cls_run.run_dir / "checkpoints" / "best.pt")
    top = max(records, key=lambda r: (r["val_auc"], r["val_accuracy"], -r["epoch"]))
    assert state["epoch"] == top["epoch"], records


def test_each_rank_checks_the_files_of_the_cases_it_loads(seg_data: Path, tmp_path: Path) -> None:
    """With several ranks, read_dataset leaves case files to make_train_data, which checks this rank's own."""
    import shutil

    import nibabel as nib
    import numpy as np

    from medseg.datasets.nifti import save_nifti
    from medseg.distributed import LocalSession
    from medseg.errors import DataError
    from medseg.training.data import make_train_data, read_dataset

    bad = tmp_path / "bad"
    shutil.copytree(seg_data, bad)
    cfg = tiny_seg_config(bad, tmp_path, name="bad")
    info, train_items, val_items = read_dataset(cfg)
    label = Path(train_items[1]["label"])
    img = nib.load(label)
    save_nifti(np.asarray(img.dataobj)[:-2], img.affine, label)
    with pytest.raises(DataError, match=f"{label.name}: label shape"):
        read_dataset(cfg)  # one process: every case, at once
    split = read_dataset(cfg, check_cases=False)  # a rank of several: nothing read yet

    class Rank(LocalSession):
        def __init__(self, own: list[int]) -> None:
            self.own = own

        def own_cases(self, n_items: int, batch_size: int, seed: int) -> tuple[list[int], int | None]:
            return self.own, None

    others = [i for i in range(len(train_items)) if i != 1]
    make_train_data(cfg, Rank(others), split, check_cases=True)  # not this rank's case: not its error
    with pytest.raises(DataError, match=f"{label.name}: label shape"):
        make_train_data(cfg, Rank([0, 1]), split, check_cases=True)


def test_profiling_leaves_the_models_batchnorm_statistics_as_they_were() -> None:
    """A rank's speed is timed with training-mode forwards on a probe batch; BatchNorm's running
    statistics must come out as they went in, or ranks that timed different step counts start
    from different models."""
    from monai.networks.nets import UNet

    from medseg.training.build import buffers_kept

    torch.manual_seed(0)
    net = UNet(3, 1, 2, (4, 8), (2,), num_res_units=1, norm="batch")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    probe = torch.randn(2, 1, 16, 16, 16) * 3 + 1

    def step() -> None:
        net(probe).sum().backward()
        net.zero_grad(set_to_none=True)

    with buffers_kept(net):
        for _ in range(3):
            step()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    step()  # outside it the same step does move the statistics
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items() if "running" in k)
