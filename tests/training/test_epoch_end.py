"""An epoch's end taken while the next epoch trains keeps the epoch as it was (medseg.training.epoch_end)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from medseg.config import TrainConfig
from medseg.distributed.local_session import LocalSession
from medseg.training.epoch_end import EpochEnd, may_stop_after
from tests.conftest import tiny_seg_config


def _run(tmp_path: Path) -> SimpleNamespace:
    """What EpochEnd reads of a run: its config, a real local session, a model, no validation cases."""
    cfg = tiny_seg_config(tmp_path / "data", tmp_path / "runs", epochs=3)
    data = SimpleNamespace(val_loader=None, val_items=[])
    return SimpleNamespace(cfg=cfg, session=LocalSession(), data=data, model=torch.nn.Linear(3, 2))


def test_a_later_message_keeps_the_checkpoint_of_the_epoch_it_ended(tmp_path: Path) -> None:
    """The chief's checkpoint contents are made at the epoch's end; taken later, they are a copy,
    so the next epoch's steps (here: a change of every weight) do not reach them."""
    run = _run(tmp_path)
    at_end = {k: v.clone() for k, v in run.model.state_dict().items()}
    ending = EpochEnd(run, {"epoch": 1}, lambda: {"model": run.model.state_dict()}, later=True)
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    numbers, scores, wall = ending.arrived()
    assert numbers == {} and scores == {} and wall > 0 and ending.val_s >= 0
    for k, v in at_end.items():
        assert torch.equal(ending.payload["model"][k], v), k


def test_only_an_epoch_after_which_no_stop_can_come_is_taken_later() -> None:
    t = TrainConfig(epochs=16, stop_at=0.85, min_epochs=8)
    assert [e for e in range(1, 17) if not may_stop_after(t, e)] == list(range(1, 8))
    assert not any(may_stop_after(TrainConfig(epochs=16, stop_at=0.0, min_epochs=8), e) for e in range(1, 17))
