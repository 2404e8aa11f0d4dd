"""Synchronisation strategies, each an optimizer wrapper the training loop steps like any optimizer.

Notation: N ranks, partitioned into groups g of |g| ranks; w the flat parameter vector of a rank;
one *round* is ``period_g`` local steps of group g, chosen so that every group completes a round in
about the same wall time (period_g = per-rank speed of g / per-rank speed of the slowest group).

``bsp``        plain Horovod: ``hvd.DistributedOptimizer`` averages gradients over all ranks every
               step (optionally Horovod's fp16 compression), or medseg's fixed-bit compressed
               allreduce.
``gssp``       group-staleness synchronous parallel (Jiang et al., CCGrid 2019, on SSP, Ho et al.
               2013). Inside a group gradients are averaged synchronously every step over the
               group's Horovod process set. Across groups, after each round r a group submits its
               own model change since its previous submission, Δ_g(r) = w − a (a: the anchor, w
               right after the last submission, not counting what was received), as an
               asynchronous global allreduce (``allreduce_async_``; each rank adds Δ_g/|g|, so the
               sum is Σ_g Δ_g) and goes on training. Completed rounds are found with ``poll`` and
               applied in order: w ← w + λ_τ (Σ_h Δ_h − Δ_g), and a ← a + the same, where the
               staleness τ = (rounds this group has submitted − 1) − r and λ_τ = 1/(τ+1) weights
               stale updates down. Before a group starts round r+1 every round ≤ r − s must have
               been applied (``synchronize`` blocks until the slowest group submitted it), so no
               group is ever more than s rounds ahead of the slowest and τ ≤ s. With DC-ASGD
               (Zheng et al., 2017) the received change is compensated for the delay,
               Δ' = Δ + λ_dc Δ⊙Δ⊙(w_now − w_then), w_then being this rank's w when round r was
               submitted. At the end of an epoch every pending round is applied and all ranks
               average w, so every rank starts the next epoch (and validates) with one model.
               With ``compression: fixed`` the round travels as fixed-bit codes instead: each
               group's first rank encodes Δ_g layer by layer with an error-feedback residual (what
               a round does not carry is added to the next) and an asynchronous ``allgather``
               (uint8) delivers the G encodings; Δ_g is then the decoded value, the same on every
               rank, so Σ_h Δ_h − Δ_g is exact.
``ssp``        gssp with one rank per group.
``local-sgd``  every rank steps alone; every ``period`` steps all ranks average w.

With one group and s = 0, gssp reduces to plain Horovod: the group is the global set, nothing is
received from other groups (Σ_h Δ_h − Δ_g = 0), and the parameters equal bsp's.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import horovod.torch as hvd
import torch

from medseg.distributed.collectives import CompressedAllreduce
from medseg.distributed.compression import ErrorFeedback, decode, encoded_nbytes

ring_allreduce_bytes = CompressedAllreduce.ring_allreduce_bytes

log = logging.getLogger(__name__)


def flat(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def assign(params: list[torch.nn.Parameter], vector: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(vector[offset : offset + n].view_as(p))
            offset += n


@dataclass
class StepStats:
    """What one rank sent and waited for; reset every epoch by the session."""

    steps: int = 0
    bytes_sent: int = 0
    wait_s: float = 0.0
    staleness: list[int] = field(default_factory=list)  # τ of every round applied this epoch
    last_staleness: int | None = None

    def reset(self) -> None:
        self.steps, self.bytes_sent, self.wait_s, self.staleness, self.last_staleness = 0, 0, 0.0, [], None


class SyncedOptimizer:
    """Base wrapper: delegates state to ``self.optimizer`` (a torch Optimizer) and adds ``stats``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.stats = StepStats()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Horovod's DistributedOptimizer.zero_grad takes no arguments; torch's default sets None.
        self.optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def step(self) -> None:
        self.optimizer.step()
        self.stats.steps += 1

    def end_epoch(self) -> None:
        """Called by every rank at the end of an epoch (a collective for some strategies)."""


class GroupAverage:
    """Averages gradients over a process set every step: Horovod's own optimizer, or fixed-bit codes."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        process_set: Any,
        compression: str,
        bits: int,
    ) -> None:
        self.size = process_set.size() if process_set is not None else 1
        self.fixed = None
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if self.size > 1 and compression == "fixed":
            # Weights of 3D convolutions are compressed; biases and norm parameters (< 1024 values)
            # travel exactly in one fused allreduce, where codes would save little.
            self.fixed = CompressedAllreduce(
                bits, process_set=process_set, min_numel=1024, name=f"grad.ps{process_set.process_set_id}"
            )
            self.optimizer = optimizer
        elif self.size > 1:
            comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
            self.elem = 2 if compression == "fp16" else 4
            self.optimizer = hvd.DistributedOptimizer(
                optimizer,
                named_parameters=model.named_parameters(),
                compression=comp,
                op=hvd.Average,
                process_set=process_set,
            )
        else:
            self.optimizer = optimizer

    def step(self) -> int:
        """Average gradients, step; return the bytes this rank sent."""
        if self.fixed is not None:
            grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.named}
            averaged = self.fixed(grads)
            for n, p in self.named:
                p.grad = averaged[n]
            self.optimizer.step()
            return self.fixed.last_bytes_sent
        self.optimizer.step()
        return ring_allreduce_bytes(self.numel, self.elem, self.size) if self.size > 1 else 0


class BulkSynchronous(SyncedOptimizer):
    """``bsp``: every step, gradients averaged over all ranks."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, compression: str, bits: int
    ) -> None:
        super().__init__(optimizer, model)
        self.average = GroupAverage(optimizer, model, hvd.global_process_set, compression, bits)
        self.optimizer = self.average.optimizer

    def step(self) -> None:
        self.stats.bytes_sent += self.average.step()
        self.stats.steps += 1


class GroupStale(SyncedOptimizer):
    """``gssp`` and ``ssp``: synchronous inside a group, bounded-staleness asynchronous across groups."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        groups: list[list[int]],
        group_set: Any,
        period: int,
        staleness: int,
        dc_lambda: float,
        compression: str,
        bits: int,
        exchange: bool | None = None,
    ) -> None:
        super().__init__(optimizer, model)
        self.groups = groups
        group = next(g for g in groups if hvd.rank() in g)
        self.average = GroupAverage(optimizer, model, group_set, compression, bits)
        self.optimizer = self.average.optimizer
        self.group_size, self.period, self.bound, self.dc_lambda = len(group), period, staleness, dc_lambda
        self.leader = hvd.rank() == min(group)
        # With one group there is nobody to exchange with; ``exchange=True`` runs the machinery anyway (tests).
        self.single_group = not (len(groups) > 1 if exchange is None else exchange)
        self.local_steps = 0
        self.rounds = 0  # rounds submitted by this group
        self.anchor = flat(self.params).clone()
        self.pending: collections.deque = collections.deque()
        self.coded = ErrorFeedback(bits) if compression == "fixed" else None
        self.bits = bits
        self.layer_sizes = [p.numel() for p in self.params]

    def step(self) -> None:
        self.stats.bytes_sent += self.average.step()
        self.stats.steps += 1
        self.local_steps += 1
        if self.single_group or self.local_steps % self.period:
            return
        self._submit()
        while self.pending and hvd.poll(self.pending[0][1]):
            self._apply(self.pending.popleft())
        # The bound: round r may be applied no later than when round r + s is submitted.
        while self.pending and self.pending[0][0] <= self.rounds - 1 - self.bound:
            tic = time.perf_counter()
            self._apply(self.pending.popleft())  # blocks in synchronize until the slowest group submitted
            self.stats.wait_s += time.perf_counter() - tic

    def _submit(self) -> None:
        w = flat(self.params)
        own = w - self.anchor
        name = f"gssp.round{self.rounds}"
        if self.coded is None:
            buf = own / self.group_size
            handle = hvd.allreduce_async_(buf, op=hvd.Sum, name=name)
            self.stats.bytes_sent += ring_allreduce_bytes(self.numel, 4, hvd.size())
        else:
            codes, own = self.coded.compress_chunks("delta", own, self.layer_sizes)
            buf = torch.cat(codes) if self.leader else torch.empty(0, dtype=torch.uint8)
            handle = hvd.allgather_async(buf, name=name)
            self.stats.bytes_sent += self._allgather_bytes()
        self.pending.append((self.rounds, handle, buf, own, w.clone() if self.dc_lambda else None))
        self.anchor = w.clone()
        self.rounds += 1

    def _allgather_bytes(self) -> int:
        """Ring allgather: a rank forwards every block but its successor's; only leaders' blocks are non-empty."""
        n, me = hvd.size(), hvd.rank()
        block = encoded_nbytes_total(self.layer_sizes, self.bits)
        return sum(block for leader in (min(g) for g in self.groups) if leader != (me + 1) % n)

    def _received(self, handle: Any, buf: torch.Tensor) -> torch.Tensor:
        """The sum over groups of what they submitted in a round."""
        if self.coded is None:
            hvd.synchronize(handle)  # the sum lands in ``buf`` (in-place allreduce)
            return buf
        gathered = hvd.synchronize(handle)
        block = encoded_nbytes_total(self.layer_sizes, self.bits)
        total = torch.zeros(self.numel)
        for start in range(0, gathered.numel(), block):
            total += decode_layers(gathered[start : start + block], self.layer_sizes, self.bits)
        return total

    def _apply(self, entry: tuple) -> None:
        r, handle, buf, own, w_then = entry
        others = self._received(handle, buf) - own
        tau = self.rounds - 1 - r
        if self.dc_lambda and w_then is not None:
            others = others + self.dc_lambda * others * others * (flat(self.params) - w_then)
        update = others / (tau + 1)
        assign(self.params, flat(self.params) + update)
        self.anchor += update
        self.stats.staleness.append(tau)
        self.stats.last_staleness = tau

    def end_epoch(self) -> None:
        tic = time.perf_counter()
        self.local_steps = 0  # an epoch holds whole rounds; the period may change for the next one
        while self.pending:
            self._apply(self.pending.popleft())
        if not self.single_group:
            average_parameters(self.params)
            self.anchor = flat(self.params).clone()
        self.stats.wait_s += time.perf_counter() - tic


class LocalSGD(SyncedOptimizer):
    """``local-sgd``: independent steps, all ranks average their parameters every ``period`` steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, period: int) -> None:
        super().__init__(optimizer, model)
        self.period = period

    def step(self) -> None:
        self.optimizer.step()
        self.stats.steps += 1
        if self.stats.steps % self.period == 0:
            average_parameters(self.params)
            self.stats.bytes_sent += ring_allreduce_bytes(self.numel, 4, hvd.size())

    def end_epoch(self) -> None:
        average_parameters(self.params)


def encoded_nbytes_total(sizes: list[int], bits: int) -> int:
    return sum(encoded_nbytes(n, bits) for n in sizes)


def decode_layers(buf: torch.Tensor, sizes: list[int], bits: int) -> torch.Tensor:
    """Decode a concatenation of per-layer encodings into one flat float32 vector."""
    out, offset = [], 0
    for n in sizes:
        size = encoded_nbytes(n, bits)
        out.append(decode(buf[offset : offset + size], bits, n))
        offset += size
    return torch.cat(out)


def average_parameters(params: list[torch.nn.Parameter]) -> None:
    """All ranks replace their parameters by the global average (one fused allreduce)."""
    vector = flat(params)
    hvd.allreduce_(vector, op=hvd.Average, name="medseg.param_average")
    assign(params, vector)
