"""The session of a job that trains in one process: the training loop's view of the backend when
there is nothing to synchronise (:class:`LocalSession`), and the seed of a rank's random draws.

:class:`~medseg.distributed.session.HorovodSession` extends :class:`LocalSession` for ranks started
by horovodrun.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from medseg.config import Config
from medseg.distributed.comm.checks import check_trained


class LocalSession:
    """One process: the optimizer is used as it is and every sample is this rank's."""

    rank, size, is_chief = 0, 1, True
    site: str | None = None
    validates = True  # this process validates (its own site's held-out cases)
    model: torch.nn.Module | None = None  # what end_epoch checks for divergence

    def prepare(self, profile_step: Callable[[], int], model: torch.nn.Module | None = None) -> None:
        """Nothing to measure in one process; the model is kept for :meth:`end_epoch`'s check."""
        self.model = model

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module
    ) -> torch.optim.Optimizer:
        return optimizer

    def own_cases(self, n_items: int, batch_size: int, seed: int) -> tuple[list[int], int | None]:
        """This rank's cases and how many it trains on per epoch (None: all, shuffled)."""
        return list(range(n_items)), None

    def share_state(self, state: Any) -> Any:
        """The chief's resume state on every rank (one process: as it is)."""
        return state

    def data_dir(self, cfg: Config) -> str:
        """The dataset this rank reads: its own site's with ``sites:``, else ``data.dir``."""
        return cfg.data.dir

    def check_sites(self, facts: dict[str, Any]) -> None:
        """One process holds one dataset: nothing to compare."""

    def finish_epoch(
        self, metrics: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]] | None]:
        """No other rank's numbers and no sites' scores in one process."""
        return {}, None

    def gather_site_local(self, optimizer: Any) -> dict[str, Any] | None:
        """Each site's own normalisation tensors on rank 0 (None: no ``dist.local_norm`` sites)."""
        return None

    def save_sync_state(self, optimizer: Any, run_dir: Path, epoch: int) -> dict[str, int] | None:
        """No synchronisation state in one process."""
        return None

    def load_sync_state(self, optimizer: Any, run_dir: Path, marker: dict[str, int] | None) -> None:
        """Nothing to restore in one process."""

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        yield

    def after_step(self, epoch: int, step: int, n_samples: int) -> None:
        """No heartbeat outside a launched job."""

    def phase(self, what: str) -> None:
        """No heartbeat outside a launched job."""

    def report(self, record: dict[str, Any]) -> None:
        """No launcher to report to outside a launched job."""

    def start_epoch(self, stop: bool = False, agreed: bool = False) -> bool:
        """Nothing to time in one process; the stop decision is this process's own."""
        return stop

    @property
    def scores_everywhere(self) -> bool:
        """Whether every rank holds the epoch's pooled validation scores after :meth:`finish_epoch`
        (then each decides early stopping itself, identically): one process holds its own."""
        return True

    def end_epoch(self, optimizer: Any) -> dict[str, Any]:
        """Refuse a diverged epoch (RunError before its checkpoint is written); no numbers to add."""
        self.check_diverged(optimizer)
        return {}

    def check_diverged(self, optimizer: Any, who: str = "this process") -> None:
        """:func:`~medseg.distributed.comm.checks.check_trained` on the model (else the optimizer's
        parameters): a NaN/Inf loss leaves them non-finite (fp16 loss scaling skips such steps itself)."""
        if self.model is not None:
            named = [*self.model.named_parameters(), *self.model.named_buffers()]
        else:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            named = [(f"parameter {i}", p) for i, p in enumerate(params)]
        check_trained([(n, t.detach()) for n, t in named], who)

    def close(self) -> None:
        """Nothing to shut down."""


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of a rank's random draws in an epoch (distinct per rank, repeatable per run)."""
    return (seed * 100_003 + epoch * 1_009 + rank) % (2**31) if rank else (seed * 100_003 + epoch) % (2**31)
