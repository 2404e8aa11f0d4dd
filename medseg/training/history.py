"""The chief's account of a run's epochs: the metrics records, the best epoch, and early stopping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from medseg.config import TrainConfig
from medseg.training.run import run_log
from medseg.training.tasks import ClassificationTask, SegmentationTask, improves


@dataclass
class History:
    """Epochs so far: metrics.jsonl's records, where training goes on, and the best epoch."""

    records: list[dict[str, Any]] = field(default_factory=list)
    start: int = 1  # the next epoch to train
    best_epoch: int | None = None
    best_record: dict[str, Any] | None = None  # the best epoch's validation record (its tie-break metric too)

    def best_metric(self, key: str) -> float | None:
        return self.best_record.get(key) if self.best_record else None

    def note_best(
        self, epoch: int, record: dict[str, Any], task: SegmentationTask | ClassificationTask
    ) -> bool:
        """Whether ``record`` improves on the best epoch so far (see :func:`improves`); if so it becomes the best."""
        is_best = improves(record, self.best_record, task.key_metric, task.tie_metric)
        if is_best:
            self.best_epoch, self.best_record = epoch, record
        return is_best


def stop_due(t: TrainConfig, metric: float | None, epoch: int) -> bool:
    """Early stopping: the key metric reached ``train.stop_at`` at or after ``train.min_epochs``."""
    return bool(t.stop_at and metric is not None and metric >= t.stop_at and epoch >= t.min_epochs)


def reached_stop_at(t: TrainConfig, key_metric: str, metric: float | None, epoch: int) -> bool:
    """:func:`stop_due`, logged when it is."""
    reached = stop_due(t, metric, epoch)
    if reached:
        run_log.info(
            "%s %.4f reached train.stop_at %.4f at epoch %d: stopping", key_metric, metric, t.stop_at, epoch
        )
    return reached
