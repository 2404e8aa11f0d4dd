"""An epoch's end: its message to every rank, taken at once or while the next epoch trains.

Every rank ends an epoch with one message (:meth:`~medseg.distributed.session.HorovodSession.finish_epoch`):
every rank's numbers and every site's validation scores, to every rank. Between sites it waits
for the farthest site's validation and then for a WAN round trip, and the next epoch needs its
answer only where the answer can stop training: once ``train.stop_at`` can be reached
(:func:`may_stop_after`). Before that, with sites, every rank starts the next epoch at once and
takes the message when that epoch's steps are done (:func:`defers`), before the channel's world
group is used again; the chief then writes the epoch's record and checkpoint. The record's
``time`` is the moment the message arrived (the pooled scores were known), whichever way it was
taken, and its checkpoint holds the model and optimiser as they were at the epoch's end.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from medseg.config import TrainConfig
from medseg.distributed.background import InBackground
from medseg.training.epoch import pooled, score
from medseg.training.run import Run

# the job's numbers, every site's scores by site, when they arrived (wall clock)
Arrived = tuple[dict[str, Any], dict[str, dict[str, Any]] | None, float]


def may_stop_after(t: TrainConfig, epoch: int) -> bool:
    """Whether early stopping can follow ``epoch`` (``train.stop_at`` set, ``train.min_epochs``
    reached): the one decision that must be known before the next epoch starts."""
    return bool(t.stop_at) and epoch >= t.min_epochs


def defers(run: Run, epoch: int, last: int) -> bool:
    """Whether ``epoch``'s message is taken while the next epoch trains: with sites (every rank
    receives every site's scores), before the loop's ``last`` epoch, when no stop can follow."""
    crosses_sites = bool(run.cfg.sites) and run.session.scores_everywhere
    return crosses_sites and epoch < last and not may_stop_after(run.cfg.train, epoch)


def _exchange(run: Run, site_scores: dict[str, Any] | None) -> Arrived:
    numbers, per_site = run.session.finish_epoch(site_scores)
    return numbers, per_site, time.time()


class EpochEnd:
    """One epoch's scores, on the chief its checkpoint contents made after validation (``payload``
    from ``checkpoint``; copied when the message is taken later, since the next epoch changes the
    model), and its message (taken now, or on a thread with ``later``). ``val_s``: the seconds
    from the start of validation until this rank trains again (without the message's wait where
    it is taken later: those seconds are the next epoch's training)."""

    def __init__(
        self,
        run: Run,
        record: dict[str, Any],
        checkpoint: Callable[[], dict[str, Any]] | None,
        later: bool,
    ) -> None:
        self.run, self.record, self.val_tic = run, record, time.perf_counter()
        self.scores, site_scores = score(run, record["epoch"])
        payload = checkpoint() if checkpoint is not None else None
        self.payload = copy.deepcopy(payload) if later else payload
        self._later = InBackground(_exchange, run, site_scores) if later else None
        self._now = None if later else _exchange(run, site_scores)
        # the seconds before this rank trains again: validation and, unless taken later, the message
        self.val_s = time.perf_counter() - self.val_tic

    def arrived(self) -> tuple[dict[str, Any], dict[str, Any], float]:
        """The job's numbers, the pooled scores, and when the message arrived (wall clock); raises
        the message's error in the caller's thread."""
        numbers, per_site, wall = self._later.result() if self._later is not None else self._now
        return numbers, pooled(self.scores, per_site), wall

    def arrives_within(self, timeout_s: float) -> bool:
        """Whether the message has arrived without error, after waiting at most ``timeout_s``:
        taken now it always has; taken later, its thread may still wait on a peer that failed."""
        if self._later is None:
            return True
        return self._later.wait(timeout_s) and self._later.failed() is None
