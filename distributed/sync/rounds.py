"""Rounds between sites for the model-averaging peers, ``fedavg`` and ``diloco``: what they share.

A *site* is the ranks of one ``sites:`` entry (or of one host). Inside a site the ranks stay in step:
every step each rank's gradients are averaged over its site (exact float32 ring allreduce on the
site's LAN) before its optimizer steps, so every rank of a site holds the same parameters and the same
optimizer state: one worker per site, training on the site's batches together. Sites train apart for
a *round*, then meet once:

1. Every rank has x_r, the shared state (parameters requiring gradients, then float buffers; without
   FedBN's local tensors, :mod:`medseg.distributed.sync.common`), and n_r, the samples it trained on
   in the round (rows of every batch the model ran forward on in training mode, counted by a forward
   pre-hook). In the site: x_s = mean over the site's ranks of x_r (the parameters are already equal;
   the buffers are not), n_s = sum of n_r.
2. Each site leader sends its site's part p_s (``fedavg``: x_s; ``diloco``: its pseudo-gradient
   Δ_s = c − x_s, c the common state at the round's start) and ``[n_s, steps]``; the leaders
   allgather them, check every site's numbers and part (below), agree on the verdict (when any
   leader refuses a site, all of them stop naming it) and form the sample-weighted mean
   p̄ = Σ_s n_s p_s / Σ_s n_s, added in site order so that every leader holds the same bits.
3. Each leader broadcasts ``[p̄, verdict]`` in its site
   (:func:`~medseg.distributed.comm.collectives.site_verdict`); every rank applies p̄ (the
   subclass's rule) and the result becomes the next round's c.

Checks, before anything received is used: a site's sample count must be an integer in
[1, K · n_own] (K = :data:`~medseg.distributed.comm.checks.K_NORM`; the weights follow the counts,
so an inflated count would let one site take over the average), rounds that end by a step count
must hold the same number of steps on every site, and a site's change since c (x_s − c, or −Δ_s)
passes :class:`~medseg.distributed.comm.checks.UpdateGuard`'s norm rule against this site's own,
with the floor ``ROUND_FLOOR · ||c||`` of :class:`~medseg.distributed.sync.common.AverageCheck`.

Bytes (``stats``, this rank): every step, ``2 (m-1)/m · 4 · (trainable elements)`` on the site's
LAN; per round, the site mean of x (``2 (m-1)/m · 4n``) and, on a leader, ``(S-1)(4n + 24)``
across sites (ring allgathers of the parts, counts and verdicts; the only WAN bytes) and ``(m-1) · 4(n+1)``
for the in-site broadcast, with n the shared elements, m the site's ranks, S the sites.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from medseg.distributed.comm.channel import Channel
from medseg.distributed.comm.checks import K_NORM, UpdateGuard, UpdateRefused, refuse_update
from medseg.distributed.comm.collectives import site_verdict
from medseg.distributed.sync.common import (
    ROUND_FLOOR,
    SyncedOptimizer,
    assign,
    flat,
    load_local,
    ring_allreduce_bytes,
)


def site_lists(rank_sites: list[str]) -> list[list[int]]:
    """The ranks of each site, in order of each site's lowest rank (``rank_sites[r]`` is r's site)."""
    by_site: dict[str, list[int]] = {}
    for r, s in enumerate(rank_sites):
        by_site.setdefault(s, []).append(r)
    return sorted(by_site.values(), key=min)


def check_counts(counts: list[list[int]], sources: list[str], own: int, same_steps: bool) -> None:
    """Every site's ``[samples, steps]`` of a round: samples in [1, K · own samples], and with rounds
    of a step count, the same steps as this site's."""
    mine_n, mine_steps = counts[own]
    for (n, steps), src in zip(counts, sources):
        if not 1 <= n <= K_NORM * max(mine_n, 1):
            raise refuse_update(
                src,
                "sample count of a round",
                f"{n} samples, this site's own {mine_n} (allowed 1 to {K_NORM:g}x)",
            )
        if same_steps and steps != mine_steps:
            raise refuse_update(
                src,
                "step count of a round",
                f"{steps} steps where this site took {mine_steps}: rounds of dist.inner_steps/local_steps need "
                "the same steps per epoch on every site",
            )


class SiteRounds(SyncedOptimizer):
    """Base of :class:`~medseg.distributed.sync.peers.FedAvg` and
    :class:`~medseg.distributed.sync.peers.DiLoCo`: in-site steps, rounds between sites (module
    docstring). A round ends after ``every_steps`` steps (0: never by steps) or at the end of every
    ``every_epochs``-th epoch (0: never by epochs); a round ended by steps also ends, shorter, at
    every epoch's end, so every checkpoint and validation sees the common model.

    Subclasses set :attr:`kind` (what the parts are, for the audit) and define :meth:`part`,
    :meth:`change` and :meth:`apply`.
    """

    kind = "parameters"
    mode = "model-averaging"
    made = itertools.count()  # engines made in this process: every rank makes them in the same order

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        channel: Channel,
        sites: list[list[int]],
        every_steps: int,
        every_epochs: int,
        local_norm: bool = False,
        name: str = "rounds",
    ) -> None:
        super().__init__(optimizer, model, local_norm)
        self.channel, self.rank = channel, channel.rank
        self.every_steps, self.every_epochs = every_steps, every_epochs
        self.sites = [sorted(s) for s in sites]
        self.site_index = next(k for k, s in enumerate(self.sites) if self.rank in s)
        site = self.sites[self.site_index]
        self.m, self.leader = len(site), site[0]
        name = f"{name}{next(SiteRounds.made)}"  # the groups' store tags, unique in the job
        self.site_group = (
            channel.make_group(f"{name}/site{'-'.join(map(str, site))}/", site) if self.m > 1 else None
        )
        leaders = [s[0] for s in self.sites]
        multi = self.rank == self.leader and len(self.sites) > 1
        self.leaders_group = channel.make_group(f"{name}/leaders/", leaders) if multi else None
        self.sources = [channel.describe(r) for r in leaders]
        self.guard = UpdateGuard(f"part of a {self.mode} round")
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.shared = self.params + self.buffers
        buffer_ids = {id(b) for b in self.local_buffers}
        self.local_params = [t for t in self.local.values() if id(t) not in buffer_ids]
        self.common = flat(self.shared).clone()  # c: the state every site started the round from
        self.samples = self.round_steps = self.epochs = self.rounds = 0
        model.register_forward_pre_hook(self._count_samples)

    def _count_samples(self, module: torch.nn.Module, args: tuple) -> None:
        if module.training and args and isinstance(args[0], torch.Tensor):
            self.samples += int(args[0].shape[0])

    # -- what a subclass decides ------------------------------------------------------------------
    def part(self, state: torch.Tensor) -> torch.Tensor:
        """What a site sends for its site-mean state ``state`` (x_s)."""
        raise NotImplementedError

    def change(self, part: torch.Tensor) -> torch.Tensor:
        """A received part as the site's change since c (what the norm rule checks)."""
        raise NotImplementedError

    def apply(self, mean: torch.Tensor) -> torch.Tensor:
        """The new common state from the sample-weighted mean part p̄."""
        raise NotImplementedError

    # -- steps and rounds ---------------------------------------------------------------------------
    def step(self) -> None:
        tic = time.perf_counter()
        if self.site_group is not None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.trainable]
            vector = flat(grads)
            self.site_group.allreduce_(vector, kind="gradients")
            assign(grads, vector / self.m)
            for p, g in zip(self.trainable, grads):
                p.grad = g
            self.stats.bytes_sent += int(ring_allreduce_bytes(vector.numel(), 4, self.m))
        self.stats.step_site_s = time.perf_counter() - tic
        self.stats.site_s += self.stats.step_site_s
        self.check_step()
        self.optimizer.step()
        self.stats.steps += 1
        self.round_steps += 1
        self.stats.step_wan_s = 0.0
        if self.every_steps and self.round_steps >= self.every_steps:
            self.stats.step_wan_s = self.close_round()

    def end_epoch(self) -> None:
        self.epochs += 1
        by_epochs = self.every_epochs and self.epochs % self.every_epochs == 0
        if by_epochs or (self.every_steps and self.round_steps):
            self.close_round()
        if self.local_buffers and self.site_group is not None:  # FedBN: the site's statistics, in-site only
            vector = flat(self.local_buffers)
            self.site_group.allreduce_(vector, kind="parameters")
            assign(self.local_buffers, vector / self.m)

    def close_round(self) -> float:
        """Steps 1-3 of the module docstring; the seconds this rank spent in them."""
        tic = time.perf_counter()
        state = flat(self.shared)
        counts = torch.tensor([self.samples, self.round_steps], dtype=torch.int64)
        if self.site_group is not None:
            self.site_group.allreduce_(state, kind="parameters")
            state /= self.m
            samples = torch.tensor([self.samples], dtype=torch.int64)
            self.site_group.allreduce_(samples)
            counts[0] = samples[0]
            self.stats.bytes_sent += int(ring_allreduce_bytes(state.numel(), 4, self.m))
        mean, error = None, None
        if self.rank == self.leader:
            try:
                mean = self._combine(self.part(state), [int(c) for c in counts])
            except UpdateRefused as exc:
                error = exc
            self.stats.bytes_sent += (self.m - 1) * 4 * (state.numel() + 1)
        what = self.guard.what
        leader_name = self.channel.describe(self.leader)
        kind = self.kind
        mean = site_verdict(
            self.site_group, self.leader, mean, error, self.sources, state.numel(), what, leader_name, kind
        )
        assign(self.shared, self.apply(mean))
        self.common = flat(self.shared).clone()
        self.samples = self.round_steps = 0
        self.rounds += 1
        spent = time.perf_counter() - tic
        self.stats.wan_wait_s += spent
        return spent

    def _combine(self, part: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Step 2 on a leader: every site's counts and part, checked, then p̄ in site order.

        The leaders then agree on the verdict (one more allgather of 8 bytes each): when any leader
        refused a site, every leader raises naming that site, the refused site's own leader too.
        """
        if self.leaders_group is None:
            return part
        got = [torch.empty(2, dtype=torch.int64) for _ in self.sites]
        self.leaders_group.allgather(got, torch.tensor(counts, dtype=torch.int64))
        parts = [torch.empty_like(part) for _ in self.sites]
        self.leaders_group.allgather(parts, part, kind=self.kind)
        sent = (len(self.sites) - 1) * (4 * part.numel() + 24)  # ring allgathers
        self.stats.bytes_sent += sent
        self.stats.wan_bytes += sent
        everyone = [[int(v) for v in g] for g in got]
        mean, error = None, None
        try:
            mean = self._checked_mean(part, parts, everyone)
        except UpdateRefused as exc:
            error = exc
        self._agree(error)
        assert mean is not None
        return mean

    def _checked_mean(
        self, part: torch.Tensor, parts: list[torch.Tensor], counts: list[list[int]]
    ) -> torch.Tensor:
        """p̄ = Σ_s n_s p_s / Σ_s n_s after every site's counts and part passed the checks."""
        check_counts(counts, self.sources, self.site_index, same_steps=bool(self.every_steps))
        same = [p.shape == part.shape for p in parts]
        changes = [self.change(p) if ok else p for p, ok in zip(parts, same)]
        floor = ROUND_FLOOR * float(self.common.norm())
        self.guard.check(changes, self.sources, own=self.site_index, shape=tuple(part.shape), floor=floor)
        total_n = sum(n for n, _ in counts)
        mean = torch.zeros_like(part)
        for (n, _), p in zip(counts, parts):
            mean += (n / total_n) * p
        return mean

    def _agree(self, error: UpdateRefused | None) -> None:
        """Every leader's verdict (0, or 1 + the refused site) to every leader; raise on any refusal."""
        assert self.leaders_group is not None
        mine = torch.tensor([0 if error is None else self.sources.index(error.source) + 1], dtype=torch.int64)
        verdicts = [torch.empty(1, dtype=torch.int64) for _ in self.sites]
        self.leaders_group.allgather(verdicts, mine)
        if error is not None:
            raise error
        for k, v in enumerate(verdicts):
            if int(v):
                leader = self.sources[k]
                raise refuse_update(
                    self.sources[int(v) - 1],
                    self.guard.what,
                    f"refused by {leader}, whose log has the numbers",
                )

    # -- checkpoints --------------------------------------------------------------------------------
    def sync_state(self) -> dict[str, Any]:
        """This rank's optimizer state, its own state and round counters (a round may span epochs)."""
        state: dict[str, Any] = {
            "optimizer": self.base.state_dict(),
            "round": {
                "own": flat(self.shared),
                "common": self.common.clone(),
                "counts": torch.tensor([self.samples, self.round_steps, self.epochs, self.rounds]),
            },
        }
        if self.local:
            state["local"] = {k: v.detach().clone() for k, v in self.local.items()}
        return state

    def load_sync_state(self, state: dict[str, Any]) -> None:
        load_local(self.local, state)
        if state.get("optimizer"):
            self.base.load_state_dict(state["optimizer"])
        saved = state.get("round")
        if saved and saved["own"].shape == self.common.shape:
            assign(self.shared, saved["own"])
            self.common = saved["common"].clone()
            self.samples, self.round_steps, self.epochs, self.rounds = (int(v) for v in saved["counts"])
