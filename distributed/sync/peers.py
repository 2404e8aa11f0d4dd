"""The strongest peers of gssp between sites: ``fedavg`` and ``diloco``, on medseg's channel.

Both run the rounds of :mod:`medseg.distributed.sync.rounds` (ranks of a site in step, sites apart
for a round, then one sample-weighted exchange between the site leaders, every site's part checked
before anything is applied); they differ in what a round is and in what is done with the mean.
"""

from __future__ import annotations

from typing import Any

import torch

from medseg.distributed.comm.channel import Channel
from medseg.distributed.sync.outer import OuterNesterov
from medseg.distributed.sync.rounds import SiteRounds

DILOCO_INNER_STEPS = 500  # H of Douillard et al. 2023 (their main setting)
DILOCO_OUTER_LR = 0.7  # the paper's outer learning rate
DILOCO_OUTER_MOMENTUM = 0.9  # the paper's outer Nesterov momentum


class FedAvg(SiteRounds):
    """``fedavg``: federated averaging (McMahan et al., AISTATS 2017, "Communication-Efficient
    Learning of Deep Networks from Decentralized Data", Algorithm 1).

    Each site is one client. A round is E local epochs (``dist.local_epochs``, default 1) of the
    site's own data with the configured optimizer (the paper's clients use SGD; whatever
    ``train.optimizer`` is here, and its state carries over between rounds), or, with
    ``dist.local_steps`` > 0, that many steps (a fraction of an epoch; such a round also ends at every
    epoch's end). Then every site's state x_s (parameters and float buffers) is replaced by::

        x ← Σ_s (n_s / n) x_s,   n = Σ_s n_s

    with n_s the samples site s trained on in the round (the paper's n_k, the client's data: here
    what it actually trained on, which is the same when sites see their cases once per epoch). The
    ranks of a site average their gradients every step, so a site is one client with the site's
    batches together. With ``local_norm`` (FedBN) the normalisation layers stay in each site.

    Args:
        optimizer: this rank's (the site's) optimizer.
        model: the model.
        channel: medseg's channel.
        sites: every site's ranks (:func:`~medseg.distributed.sync.rounds.site_lists`).
        local_epochs: E, epochs per round (when ``local_steps`` is 0).
        local_steps: steps per round instead (0: rounds of ``local_epochs``).
        local_norm: keep the normalisation layers in the site (FedBN).
    """

    kind = "parameters"
    mode = "fedavg"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        channel: Channel,
        sites: list[list[int]],
        local_epochs: int = 1,
        local_steps: int = 0,
        local_norm: bool = False,
    ) -> None:
        every_epochs = 0 if local_steps else local_epochs
        super().__init__(
            optimizer, model, channel, sites, local_steps, every_epochs, local_norm, name="fedavg"
        )

    def part(self, state: torch.Tensor) -> torch.Tensor:
        return state

    def change(self, part: torch.Tensor) -> torch.Tensor:
        return part - self.common

    def apply(self, mean: torch.Tensor) -> torch.Tensor:
        return mean


class DiLoCo(SiteRounds):
    """``diloco``: Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
    Models" (arXiv:2311.08105), Algorithm 1, with sites as its workers.

    Round t starts from the common parameters θ^(t-1) on every site. Each site takes H inner steps
    (``dist.inner_steps``, default 500 as in the paper) with the configured optimizer (AdamW in the
    paper: ``train.optimizer: adamw``; its state carries over between rounds, as the paper's
    workers keep theirs); a round also ends, shorter, at every epoch's end. Then, with θ_s the
    site's parameters and n_s the samples it trained on in the round::

        Δ_s = θ^(t-1) − θ_s                              (the site's pseudo-gradient)
        Δ   = Σ_s (n_s / n) Δ_s,   n = Σ_s n_s            (the paper's 1/k Σ, weighted by samples)
        θ^(t) = OuterNesterov(θ^(t-1), Δ)                  (lr η = 0.7, momentum μ = 0.9)

    :class:`OuterNesterov` states the outer rule (``dist.outer_lr``, ``dist.outer_momentum``). With
    η = 1 and μ = 0 this is FedAvg with rounds of H steps. Float buffers (BatchNorm statistics) are not
    optimised: they take the sample-weighted mean of the sites' (θ^(t-1) − Δ for that part). Sites
    send Δ_s (audit kind ``model-change``). All ranks apply the same Δ to the same θ^(t-1), so every
    rank holds the same outer momentum, kept in :meth:`sync_state`.

    Args:
        optimizer: this rank's inner optimizer (the site's).
        model: the model.
        channel: medseg's channel.
        sites: every site's ranks.
        inner_steps: H.
        outer_lr: η of the outer step.
        outer_momentum: μ of the outer step (Nesterov).
        local_norm: keep the normalisation layers in the site (FedBN).
    """

    kind = "model-change"
    mode = "diloco"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        channel: Channel,
        sites: list[list[int]],
        inner_steps: int = DILOCO_INNER_STEPS,
        outer_lr: float = DILOCO_OUTER_LR,
        outer_momentum: float = DILOCO_OUTER_MOMENTUM,
        local_norm: bool = False,
    ) -> None:
        super().__init__(optimizer, model, channel, sites, inner_steps, 0, local_norm, name="diloco")
        self.outer = OuterNesterov(outer_lr, outer_momentum)
        self.n_params = sum(p.numel() for p in self.params)

    def part(self, state: torch.Tensor) -> torch.Tensor:
        return self.common - state

    def change(self, part: torch.Tensor) -> torch.Tensor:
        return part  # −(x_s − c): the same norm

    def apply(self, mean: torch.Tensor) -> torch.Tensor:
        k = self.n_params
        theta = self.outer.step(self.common[:k], mean[:k])
        return torch.cat([theta, self.common[k:] - mean[k:]])

    def sync_state(self) -> dict[str, Any]:
        return {**super().sync_state(), "outer": self.outer.state_dict()}

    def load_sync_state(self, state: dict[str, Any]) -> None:
        super().load_sync_state(state)
        self.outer.load_state_dict(state.get("outer") or {})
