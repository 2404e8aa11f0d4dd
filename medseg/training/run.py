"""What a training run is made of once built: its files, its pieces on this rank, and its result.

:mod:`medseg.training.loop` builds a :class:`Run` once (:func:`medseg.training.build.build_run`) and
hands it to the helpers of each epoch instead of a long list of arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medseg.config import Config
from medseg.distributed import LocalSession
from medseg.training.data import TrainData
from medseg.training.tasks import ClassificationTask, SegmentationTask

# The run's own account (memory mode, resume, early stop, each epoch, the end) is logged under the
# loop's name whichever helper writes it, so train.log reads as one component's record of the run.
run_log = logging.getLogger("medseg.training.loop")


@dataclass
class TrainResult:
    run_dir: Path
    epochs: int
    best_metric: float | None
    best_epoch: int | None
    key_metric: str
    last_record: dict[str, Any]


@dataclass(frozen=True)
class RunPaths:
    """The files of ``<runs_dir>/<name>/`` the loop reads and writes."""

    run_dir: Path
    last: Path  # checkpoints/last.pt: every epoch's state, what --resume continues from
    best: Path  # checkpoints/best.pt: the best epoch's state, what the bundle is made of
    metrics: Path  # metrics.jsonl: one record per epoch

    @classmethod
    def of(cls, cfg: Config) -> RunPaths:
        ckpt_dir = cfg.run_dir / "checkpoints"
        return cls(cfg.run_dir, ckpt_dir / "last.pt", ckpt_dir / "best.pt", cfg.run_dir / "metrics.jsonl")


@dataclass
class Amp:
    """Mixed precision: autocast on CUDA (bf16, or fp16 with loss scaling where bf16 is missing)."""

    enabled: bool
    dtype: torch.dtype
    scaler: torch.amp.GradScaler


@dataclass
class Run:
    """One rank's training run: the config, the session, and what was built from them."""

    cfg: Config
    session: LocalSession
    paths: RunPaths
    device: torch.device
    labels: dict[int, str]
    task: SegmentationTask | ClassificationTask
    model: torch.nn.Module
    base_optimizer: torch.optim.Optimizer  # the torch optimizer: its learning rate and state
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    amp: Amp
    data: TrainData
    train_start: float  # wall clock when training began (before profiling): time-to-accuracy's origin
    progress: bool  # progress bars
    # The session's wrapper around base_optimizer (it synchronises); set once the resume state is in.
    optimizer: Any = None
