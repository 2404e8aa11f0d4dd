"""``local-sgd``: independent steps on every rank, the model averaged over all ranks every few steps."""

from __future__ import annotations

from typing import Any

import torch

from medseg.distributed.comm.channel import Channel
from medseg.distributed.sync.common import (
    AverageCheck,
    SyncedOptimizer,
    average_model,
    load_local,
    site_average,
)


class LocalSGD(SyncedOptimizer):
    """``local-sgd``: independent steps; every ``period`` steps all ranks average w and the buffers.

    Notation as in :mod:`medseg.distributed.sync.common`; w_r is rank r's parameter vector, H the
    ``period``.

    1. Every step, each rank steps its own optimizer on its own gradients: w_r ← w_r − η g_r (or
       whatever update its optimizer makes); nothing is sent.
    2. After every H-th step of the epoch, and at the end of the epoch, every rank replaces its
       parameters and float buffers by the rank-weighted mean over all N ranks,
       w_r ← (1/N) Σ_q w_q (:func:`~medseg.distributed.sync.common.average_model`: an average in
       each group, then one allreduce of |g|·(group mean) between the group leaders, so one copy per
       group crosses the WAN).
    3. With ``local_norm`` the normalisation layers' parameters and buffers are averaged in the site
       only (:func:`~medseg.distributed.sync.common.site_average`).

    Every site's part of an average is checked before it is used
    (:class:`~medseg.distributed.sync.common.AverageCheck`: finite, the model's shape, its change
    since the last average within K times that site's recent changes or this site's own), and a
    step with a non-finite gradient (a diverged loss) is refused before it is taken.

    Every rank steps its own optimizer, so :meth:`sync_state` holds its optimizer state.

    Args:
        optimizer: the torch optimizer of this rank.
        model: the model; its parameters requiring gradients form w.
        channel: medseg's channel, with the groups set.
        period: H, steps between two averages.
        local_norm: keep the normalisation layers in the site (FedBN).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        channel: Channel,
        period: int,
        local_norm: bool = False,
    ) -> None:
        super().__init__(optimizer, model, local_norm)
        self.channel, self.period = channel, period
        buffer_ids = {id(b) for b in self.local_buffers}
        self.local_params = [t for t in self.local.values() if id(t) not in buffer_ids]
        self.average_check = AverageCheck(channel, self.params + self.buffers, "part of the model average")

    def step(self) -> None:
        self.check_step()
        self.optimizer.step()
        self.stats.steps += 1
        if self.stats.steps % self.period == 0:
            before = self.stats.wan_wait_s
            average_model(self.channel, self.params + self.buffers, self.stats, self.average_check)
            site_average(self.channel, self.local_params + self.local_buffers)
            self.stats.step_wan_s = self.stats.wan_wait_s - before
        else:
            self.stats.step_wan_s = 0.0

    def end_epoch(self) -> None:
        average_model(self.channel, self.params + self.buffers, self.stats, self.average_check)
        site_average(self.channel, self.local_params + self.local_buffers)

    def sync_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"optimizer": self.base.state_dict()}  # every rank steps its own optimizer
        if self.local:
            state["local"] = {k: v.detach().clone() for k, v in self.local.items()}
        return state

    def load_sync_state(self, state: dict[str, Any]) -> None:
        load_local(self.local, state)
        if state.get("optimizer"):
            self.base.load_state_dict(state["optimizer"])
