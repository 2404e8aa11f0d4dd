"""Outer optimizers: what a round's mean change does to the model shared by the sites.

DiLoCo (Douillard et al., 2023) treats the sites' mean change of a round as a pseudo-gradient and
steps an outer optimizer with it; plain averaging (FedAvg's, local SGD's) is its degenerate case,
learning rate 1 and no momentum. ``diloco`` (:mod:`medseg.distributed.sync.peers`) and ``gssp``
with ``dist.outer: nesterov`` (:mod:`medseg.distributed.sync.gssp`) both use :class:`OuterNesterov`.
"""

from __future__ import annotations

from typing import Any

import torch


class OuterNesterov:
    """SGD with Nesterov momentum on a flat vector: DiLoCo's outer optimizer.

    With Δ the averaged pseudo-gradient of the round t (θ is moved *against* it, as against a
    gradient), momentum μ and learning rate η::

        b_1 = Δ_1,   b_t = μ b_{t-1} + Δ_t                 (momentum buffer, no dampening)
        θ_t = θ_{t-1} − η (Δ_t + μ b_t)                      (Nesterov's look-ahead)

    the rule of ``torch.optim.SGD(nesterov=True, dampening=0, weight_decay=0)``, written out here
    (tests/distributed/mp/peers_replay.py checks the engine against torch's optimizer).
    """

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr, self.momentum = float(lr), float(momentum)
        self.buffer: torch.Tensor | None = None

    def step(self, theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """θ after one outer step from ``theta`` with the pseudo-gradient ``delta``."""
        if self.buffer is None:
            self.buffer = delta.clone()
        else:
            self.buffer = self.momentum * self.buffer + delta
        return theta - self.lr * (delta + self.momentum * self.buffer)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer.clone()} if self.buffer is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffer = state.get("buffer")
        self.buffer = buffer.clone() if buffer is not None else None
