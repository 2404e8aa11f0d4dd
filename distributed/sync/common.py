"""Synchronisation strategies, each an optimizer wrapper the training loop steps like any optimizer.

Notation: N ranks, partitioned into groups g of |g| ranks (by default one group per host, i.e. per
hospital site); G groups; w the flat parameter vector; η the learning rate. One *round* of group g
is ``period_g`` local steps, chosen so that every group completes a round in about the same wall
time (period_g = per-rank speed of g / per-rank speed of the slowest group). Where each collective
runs (Horovod, a site's ``torch.distributed`` group, or the leaders' group) is tabled in
:mod:`medseg.distributed.comm.channel`.

``bsp``        plain Horovod: ``hvd.DistributedOptimizer`` averages gradients over all ranks every
               step (optionally Horovod's fp16 compression), or medseg's fixed-bit compressed
               allreduce: over the global process set on one host, site-aware (exact in each
               site, codes across sites once per site and shard, on medseg's channel) when the
               ranks sit on several hosts. Float buffers (BatchNorm statistics) are averaged at
               each epoch end; parameters are not (every rank already holds the same ones).
``gssp``       group-staleness synchronous parallel (Jiang et al., CCGrid 2019, on SSP, Ho et al.
               2013). Inside a group, gradients are averaged synchronously every step on the
               group's own process group, so every member holds the same w. Across groups, at the
               end of its round k a group submits its own model change since its previous
               submission, Δ_g(k) = w − a (a: the anchor, w right after the last submission, not
               counting what was received): the group's leader (its lowest rank) starts an
               asynchronous allreduce of c_g Δ_g(k) over the leaders' group,
               S(k) = Σ_h c_h Δ_h(k), and the group trains on. a ← w. The weights c_h are the groups'
               shares of the samples in a round (c_h ∝ |h| · period_h, Σ_h c_h = 1; FedAvg's weighting),
               so S(k) is the groups' weighted mean change. Then the leader decides how many of the oldest pending
               rounds to apply now, n = max(#completed, #forced) where round r is *forced* when
               r ≤ k − s, and tells its group (an in-site broadcast, so the members stay
               identical). For each applied round r the leader waits for S(r) (a forced round waits
               until the slowest group has submitted it) and broadcasts it in its site; every member
               then moves from its own change to the mean change, weighted down by its staleness
               τ = k − r:

                   u = (S(r) − Δ_g(r)) / max(τ, 1);   w ← w + u;   a ← a + u.

               At τ ≤ 1 every group thus holds a_0 + S(r) (+ its own later rounds): one model, as in
               local SGD, which an epoch of G groups moves as far as bsp's epoch moves one. Adding
               the other groups' full changes instead (u = S_sum − Δ_g, asynchronous SGD's rule) moves
               the model G times as far in the direction all groups share; with rounds long enough to
               hide the WAN that overshoots: gssp's held-out Dice fell from 0.54 to 0.24 between two
               epochs at 20 Mbit/s (docs/benchmarks.md, "Between hospitals").
               τ = 1 is the pipeline itself: a round exchanged while the next one computes (what
               ``dist.hide_wan`` arranges on purpose) is applied one round late, so it keeps its full
               weight, and only rounds later than that are damped, by the staleness-dependent rate
               η/τ of Zhang et al. (IJCAI 2016). (Damping by 1/(τ + 1) halved every remote change
               of a pipelined run: 0.63 against bsp's 0.77 held-out Dice after 5 epochs at
               20 Mbit/s, docs/benchmarks.md.)

               So no group starts round k + 1 before every group has submitted round k − s: a group
               never leads the slowest by more than s completed rounds when it starts a round, and
               τ ≤ s. With DC-ASGD (Zheng et al., ICML 2017) the other groups' change (the part
               S(r) − c_g Δ_g(r) that came from them) is compensated for the delay first. Their gradient g was taken at w_then (this group's w when round
               r was submitted) and is applied at w_now; DC-ASGD uses g + λ g⊙g⊙(w_now − w_then),
               the diagonal of the outer-product approximation of the Hessian. For a model change
               Δ = −η g that is (:func:`dc_compensate`)

                   Δ' = Δ − (λ/η) Δ⊙Δ⊙(w_now − w_then).

               At the end of an epoch every pending round is applied and all ranks average w and
               the float buffers (:func:`average_model`), so every rank starts the next epoch (and
               validates) with one model. With ``compression: fixed`` a round travels as fixed-bit
               codes: every member encodes Δ_g layer by layer with the same error-feedback residual
               (what a round does not carry is added to the next; the members' inputs are identical,
               so are their codes and residuals), the leaders ``all_gather`` the G encodings
               asynchronously, and Δ_g is then the decoded value, the same on every rank; each
               group forms S(r) = Σ_h c_h Δ_h(r) from the decoded changes in group order.
``ssp``        gssp with one rank per group.
``local-sgd``  every rank steps alone; every ``period`` steps all ranks average w and the buffers.

``local_norm`` (FedBN, Li et al., ICLR 2021), for gssp, ssp and local-sgd: the parameters and running
statistics of normalisation layers (:func:`norm_state`) are taken out of w and of the buffers, so no
round, model average or epoch-end buffer average sends them to another site. Inside a site they
stay identical (their gradients are averaged in-site every step like the others', and their running
statistics are averaged in-site at each epoch end), so each site keeps one model whose shared part
is everyone's and whose normalisation is its own.

With one group and s = 0, gssp reduces to synchronous data parallelism: nothing is received from
other groups (S − Δ_g = 0) and the parameters equal bsp's (tests/distributed/mp/gssp_equals_bsp.py). With
several groups its result is what a single process replaying the logged schedule computes
(tests/distributed/mp/gssp_replay.py): every engine logs, in ``events``, each round it submitted and each round
it applied, at which round boundary and with which τ.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from medseg.distributed.comm import audit
from medseg.distributed.comm.channel import Channel, HorovodTransport, TorchTransport
from medseg.distributed.comm.collectives import CompressedAllreduce, HierarchicalCompressedAllreduce
from medseg.distributed.comm.compression import ErrorFeedback, decode, encoded_nbytes

ring_allreduce_bytes = CompressedAllreduce.ring_allreduce_bytes

log = logging.getLogger(__name__)


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in tensors])


def assign(tensors: list[torch.Tensor], vector: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in tensors:
            n = p.numel()
            p.copy_(vector[offset : offset + n].view_as(p))
            offset += n


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Buffers that training changes and an average makes sense of (BatchNorm running statistics)."""
    return [b for b in model.buffers() if b.is_floating_point()]


NORM_TYPES = (
    torch.nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm* (running stats when tracked)
    torch.nn.GroupNorm,
    torch.nn.LayerNorm,
)


def norm_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and float buffers of the model's normalisation layers, by state_dict name (FedBN's
    local part)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, NORM_TYPES):
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if t is not None and t.is_floating_point():
                    out[f"{prefix}.{name}" if prefix else name] = t
    return out


def site_average(channel: Channel, tensors: list[torch.Tensor]) -> None:
    """Average ``tensors`` over this rank's group (its site) only, in place."""
    if tensors and len(channel.group) > 1:
        vector = flat(tensors)
        channel.group_mean_(vector)
        assign(tensors, vector)


def dc_compensate(
    delta: torch.Tensor, w_now: torch.Tensor, w_then: torch.Tensor, lam: float, lr: float
) -> torch.Tensor:
    """DC-ASGD's delay compensation of a model change ``delta`` (= −lr·g) computed at ``w_then``.

    g' = g + λ g⊙g⊙(w_now − w_then) with g = −Δ/η gives Δ' = Δ − (λ/η) Δ⊙Δ⊙(w_now − w_then).
    """
    if lam == 0.0 or lr <= 0.0:
        return delta
    return delta - (lam / lr) * delta * delta * (w_now - w_then)


@dataclass
class StepStats:
    """What one rank sent and waited for; reset every epoch by the session."""

    steps: int = 0
    bytes_sent: int = 0  # every byte this rank put into a collective (model of the algorithm)
    wan_bytes: int = 0  # of those, the bytes that cross between hosts (sites)
    site_s: float = 0.0  # time in in-group (in-site) averaging
    wan_wait_s: float = 0.0  # time waiting for other groups (forced rounds, epoch-end average)
    staleness: list[int] = field(default_factory=list)  # τ of every round applied this epoch
    last_staleness: int | None = None
    step_site_s: float = 0.0  # in-site averaging time of the last step
    step_wan_s: float = 0.0  # waiting on other sites in the last step
    inflight: bool = False  # a cross-group round was in flight when the last step began

    def reset(self) -> None:
        self.steps, self.bytes_sent, self.wan_bytes = 0, 0, 0
        self.site_s, self.wan_wait_s, self.staleness, self.last_staleness = 0.0, 0.0, [], None


class SyncedOptimizer:
    """Base wrapper: delegates state to ``self.optimizer`` (a torch Optimizer) and adds ``stats``."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, local_norm: bool = False
    ) -> None:
        self.optimizer = optimizer
        self.base = optimizer
        # local_norm: normalisation tensors stay in the site (never in params/buffers that cross)
        self.local = norm_state(model) if local_norm else {}
        kept = {id(t) for t in self.local.values()}
        self.params = [p for p in model.parameters() if p.requires_grad and id(p) not in kept]
        self.buffers = [b for b in float_buffers(model) if id(b) not in kept]
        self.local_buffers = [b for b in float_buffers(model) if id(b) in kept]
        self.numel = sum(p.numel() for p in self.params)
        self.stats = StepStats()
        self.events: list[tuple] = []

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Horovod's DistributedOptimizer.zero_grad takes no arguments; torch's default sets None.
        self.optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict(state)

    def sync_state(self) -> dict[str, Any]:
        """This rank's own synchronisation state (error-feedback residuals), for checkpoints."""
        return {}

    def load_sync_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`sync_state` (a resumed run continues the residuals)."""

    def step(self) -> None:
        self.optimizer.step()
        self.stats.steps += 1

    def end_epoch(self) -> None:
        """Called by every rank at the end of an epoch (a collective for some strategies)."""


def _successor_on_other_host(rank: int, hosts: list[str]) -> bool:
    return hosts[rank] != hosts[(rank + 1) % len(hosts)]


class BulkSynchronous(SyncedOptimizer):
    """``bsp``: plain Horovod, gradients averaged over all ranks every step.

    Bytes: Gloo's ring allreduce sends 2(N−1)/N of the payload from each rank to its successor
    (rank r + 1 mod N), so this rank's bytes cross the WAN when its successor is on another host.

    With ``compression: fixed`` and ranks on two or more hosts (sites), the gradients go through
    :class:`~medseg.distributed.comm.collectives.HierarchicalCompressedAllreduce` on medseg's channel:
    exact in each site, 4-bit codes only between one rank per site and shard, so about one byte per
    gradient element crosses the WAN in all (2 sites x 2 ranks) instead of 1.75 with the flat
    compressed allreduce over every rank and 12 with float32 ring allreduce. On one host the flat
    :class:`~medseg.distributed.comm.collectives.CompressedAllreduce` over Horovod's global set runs as before.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        compression: str,
        bits: int,
        hosts: list[str],
        channel: Channel | None = None,
    ) -> None:
        import horovod.torch as hvd

        super().__init__(optimizer, model)
        self.hvd, self.size = hvd, hvd.size()
        self.crosses = _successor_on_other_host(hvd.rank(), hosts)
        # the alltoall sends one block to each other rank; near-equal blocks, so this share crosses
        others = [r for r in range(self.size) if r != hvd.rank()]
        self.alltoall_wan_share = sum(hosts[r] != hosts[hvd.rank()] for r in others) / max(len(others), 1)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.fixed = None
        self.hier = None
        sites: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            sites.setdefault(h, []).append(r)
        if compression == "fixed" and self.size > 1 and len(sites) > 1 and channel is not None:
            # Same threshold as the flat scheme: 3D convolution weights in codes, biases and norms exact.
            self.hier = HierarchicalCompressedAllreduce(
                bits, list(sites.values()), hvd.rank(), channel.make_group, min_numel=1024, name="grad.bsp"
            )
            if hvd.rank() == 0:
                log.info(
                    "bsp fixed-%d: site-aware compressed allreduce, sites %s, %d shards",
                    bits,
                    list(sites.values()),
                    self.hier.n_shards,
                )
        elif compression == "fixed" and self.size > 1:
            # Weights of 3D convolutions are compressed; biases and norm parameters (< 1024 values)
            # travel exactly in one fused allreduce, where codes would save little.
            ps = hvd.global_process_set
            self.fixed = CompressedAllreduce(
                bits, min_numel=1024, name="grad.bsp", transport=HorovodTransport(hvd, ps)
            )
        elif self.size > 1:
            comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
            self.elem = 2 if compression == "fp16" else 4
            self.optimizer = hvd.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters(), compression=comp, op=hvd.Average
            )

    def step(self) -> None:
        tic = time.perf_counter()
        codes = self.hier if self.hier is not None else self.fixed
        if codes is not None:
            grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.named}
            averaged = codes(grads)
            for n, p in self.named:
                p.grad = averaged[n]
            self.base.step()
            sent = codes.last_bytes_sent
            if self.hier is not None:
                wan = self.hier.last_wan_bytes
            else:
                parts = self.fixed.last_bytes
                # ring allgather and ring allreduce cross when the successor is elsewhere; the alltoall in part
                wan = parts["alltoall"] * self.alltoall_wan_share + (
                    parts["allgather"] + parts["allreduce"] if self.crosses else 0.0
                )
        else:
            self.optimizer.step()
            sent = ring_allreduce_bytes(self.numel, self.elem, self.size) if self.size > 1 else 0
            wan = sent if self.crosses else 0.0
        self.stats.step_site_s = time.perf_counter() - tic
        self.stats.bytes_sent += int(sent)
        self.stats.wan_bytes += int(wan)
        self.stats.steps += 1
        if self.hier is None:  # the channel's groups log their own buffers
            self._audit("gradients", sent)

    def _audit(self, kind: str, nbytes: float) -> None:
        """Horovod's buffers are not seen by the channel's hook: log them by their ring bytes."""
        log_ = audit.current()
        if log_ is not None and self.size > 1:
            log_.sent_modelled(range(self.size), "horovod-allreduce", kind, int(nbytes), "float32")

    def end_epoch(self) -> None:
        if self.buffers and self.size > 1:
            vector = self.hvd.allreduce(flat(self.buffers), op=self.hvd.Average, name="medseg.buffers")
            assign(self.buffers, vector)
            sent = ring_allreduce_bytes(vector.numel(), 4, self.size)
            self.stats.bytes_sent += int(sent)
            self.stats.wan_bytes += int(sent) if self.crosses else 0
            self._audit("parameters", sent)

    def sync_state(self) -> dict[str, Any]:
        if self.hier is not None:
            return {"hier": self.hier.state_dict()}
        return {"fixed": self.fixed.state_dict()} if self.fixed is not None else {}

    def load_sync_state(self, state: dict[str, Any]) -> None:
        if self.hier is not None and state.get("hier"):
            self.hier.load_state_dict(state["hier"])
        if self.fixed is not None and state.get("fixed"):
            self.fixed.load_state_dict(state["fixed"])


class GroupAverage:
    """Averages gradients over this rank's group every step, on the group's own process group."""

    def __init__(self, model: torch.nn.Module, channel: Channel, compression: str, bits: int) -> None:
        self.channel = channel
        self.size = len(channel.group)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.numel = sum(p.numel() for _, p in self.named)
        self.compression = compression
        self.fixed = None
        if self.size > 1 and compression == "fixed":
            transport = TorchTransport(channel.group_pg)
            self.fixed = CompressedAllreduce(bits, min_numel=1024, name="grad.group", transport=transport)

    def __call__(self) -> int:
        """Replace every gradient by the group's average; return the bytes this rank sent."""
        if self.size == 1:
            return 0
        for _, p in self.named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.fixed is not None:
            averaged = self.fixed({n: p.grad for n, p in self.named})
            for n, p in self.named:
                p.grad = averaged[n]
            return int(self.fixed.last_bytes_sent)
        grads = [p.grad for _, p in self.named]
        vector = flat(grads)
        if self.compression == "fp16":
            half = vector.half()
            self.channel.group_pg.allreduce_(half)
            vector = half.float() / self.size
        else:
            self.channel.group_mean_(vector)
        assign(grads, vector)
        elem = 2 if self.compression == "fp16" else 4
        return int(ring_allreduce_bytes(self.numel, elem, self.size))


def average_model(channel: Channel, tensors: list[torch.Tensor], stats: StepStats) -> None:
    """Every rank replaces ``tensors`` by their average over all ranks, one WAN copy per group.

    Members average in their group; the leaders allreduce |g|·(group mean) and divide by N (the
    same rank-weighted mean as a global allreduce); each leader broadcasts the result in its group.
    """
    if not tensors:
        return
    tic = time.perf_counter()
    vector = flat(tensors)
    channel.group_mean_(vector)
    if len(channel.groups) > 1 and channel.leaders_pg is not None:
        vector *= len(channel.group)
        channel.leaders_pg.allreduce_(vector, kind="parameters")
        vector /= channel.size
        sent = int(ring_allreduce_bytes(vector.numel(), 4, len(channel.groups)))
        stats.bytes_sent += sent
        stats.wan_bytes += sent
    channel.group_broadcast(vector)
    assign(tensors, vector)
    stats.wan_wait_s += time.perf_counter() - tic


@dataclass
class _Round:
    r: int
    work: Any  # the leaders' async work handle (None on non-leaders)
    buf: Any  # what the work fills: the sum (none) or the list of gathered codes (fixed)
    own: torch.Tensor  # Δ_g(r) as the other groups will see it
    w_then: torch.Tensor | None


class GroupStale(SyncedOptimizer):
    """``gssp`` and ``ssp``: synchronous inside a group, bounded-staleness asynchronous across groups."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        channel: Channel,
        period: int,
        staleness: int,
        dc_lambda: float,
        compression: str,
        bits: int,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        exchange: bool | None = None,
        local_norm: bool = False,
        weights: list[float] | None = None,
    ) -> None:
        super().__init__(optimizer, model, local_norm)
        self.channel = channel
        # In-site links are fast: the per-step average stays exact; compression is for the WAN rounds.
        self.average = GroupAverage(model, channel, "none", bits)
        self.group_size, self.period, self.bound, self.dc_lambda = (
            len(channel.group),
            period,
            staleness,
            dc_lambda,
        )
        self.leader = channel.is_leader
        self.n_groups = len(channel.groups)
        # c_h: each group's share of a round's samples (equal when not given)
        raw = list(weights) if weights is not None else [1.0] * self.n_groups
        if len(raw) != self.n_groups or min(raw) <= 0:
            raise ValueError(f"weights {raw} must be positive, one per group ({self.n_groups})")
        self.weights = [float(x) / sum(raw) for x in raw]
        self.own_weight = self.weights[channel.groups.index(channel.group)]
        # With one group there is nobody to exchange with; ``exchange=True`` runs the machinery anyway (tests).
        self.single_group = not (self.n_groups > 1 if exchange is None else exchange)
        self.on_event = on_event or (lambda record: None)
        self.local_steps = 0
        self.rounds = 0  # rounds submitted by this group
        self.anchor = flat(self.params).clone()
        self.pending: collections.deque[_Round] = collections.deque()
        self.coded = ErrorFeedback(bits) if compression == "fixed" else None
        self.bits = bits
        self.layer_sizes = [p.numel() for p in self.params]
        self.block = sum(encoded_nbytes(n, bits) for n in self.layer_sizes)

    # -- per step -------------------------------------------------------------------------------
    def step(self) -> None:
        self.stats.inflight = self.leader and any(not e.work.is_completed() for e in self.pending)
        tic = time.perf_counter()
        self.stats.bytes_sent += self.average()
        self.stats.step_site_s = time.perf_counter() - tic
        self.stats.site_s += self.stats.step_site_s
        self.stats.step_wan_s = 0.0
        self.optimizer.step()
        self.stats.steps += 1
        self.local_steps += 1
        if self.single_group or self.local_steps % self.period:
            return
        self._submit()
        self._apply_due(final=False)

    def _submit(self) -> None:
        w = flat(self.params)
        own = w - self.anchor
        k = self.rounds
        work, buf = None, None
        if self.leader:
            self.on_event({"ev": "submit", "round": k, "t": time.time()})  # before the op can complete
        if self.coded is None:
            if self.leader:
                buf = own * self.own_weight
                work = self.channel.leaders_pg.allreduce_(buf, async_op=True, kind="model-change")
                self._count_leaders(ring_allreduce_bytes(self.numel, 4, self.n_groups))
        else:
            codes, own = self.coded.compress_chunks("delta", own, self.layer_sizes)
            if self.leader:
                mine = torch.cat(codes)
                buf = [torch.empty_like(mine) for _ in range(self.n_groups)]
                work = self.channel.leaders_pg.allgather(buf, mine, async_op=True, kind="model-change")
                self._count_leaders((self.n_groups - 1) * self.block)  # ring allgather
        self.pending.append(_Round(k, work, buf, own, w.clone() if self.dc_lambda else None))
        self.events.append(("submit", k, self.stats.steps))
        self.anchor = w.clone()
        self.rounds += 1

    def _count_leaders(self, nbytes: float) -> None:
        self.stats.bytes_sent += int(nbytes)
        self.stats.wan_bytes += int(nbytes)

    def _apply_due(self, final: bool) -> None:
        """Apply the rounds the leader finds complete, and every forced one (all of them if ``final``)."""
        k = self.rounds - 1
        forced = len(self.pending) if final else sum(1 for e in self.pending if e.r <= k - self.bound)
        n = forced
        if self.leader and not final:
            ready = 0
            for e in self.pending:
                if not e.work.is_completed():
                    break
                ready += 1
            n = max(ready, forced)
        if self.group_size > 1 and not final:
            box = torch.tensor([n], dtype=torch.int64)
            self.channel.group_broadcast(box)
            n = int(box.item())
        tic = time.perf_counter()
        for _ in range(n):
            self._apply(self.pending.popleft(), k)
        waited = time.perf_counter() - tic
        self.stats.step_wan_s += waited
        self.stats.wan_wait_s += waited
        if self.leader:
            self.on_event(
                {"ev": "start", "round": self.rounds, "t": time.time(), "pending": len(self.pending)}
            )

    def _received(self, e: _Round) -> torch.Tensor:
        """S(r) = Σ_h c_h Δ_h(r): the leader waits for it, then its group receives it in-site."""
        if self.coded is None:
            total = e.buf if self.leader else torch.empty(self.numel)
            if self.leader:
                e.work.wait()
            self.channel.group_broadcast(total)
            return total
        gathered = (
            torch.cat(e.buf) if self.leader else torch.empty(self.n_groups * self.block, dtype=torch.uint8)
        )
        if self.leader:
            e.work.wait()
            gathered = torch.cat(e.buf)
        self.channel.group_broadcast(gathered)
        total = torch.zeros(self.numel)
        for h, start in enumerate(range(0, gathered.numel(), self.block)):
            total += self.weights[h] * decode_layers(
                gathered[start : start + self.block], self.layer_sizes, self.bits
            )
        return total

    def _apply(self, e: _Round, boundary: int) -> None:
        mean = self._received(e)
        tau = self.rounds - 1 - e.r
        if self.dc_lambda and e.w_then is not None:
            lr = float(self.base.param_groups[0]["lr"])
            others = mean - self.own_weight * e.own  # what the other groups contributed
            mean = self.own_weight * e.own + dc_compensate(
                others, flat(self.params), e.w_then, self.dc_lambda, lr
            )
        update = (mean - e.own) / max(tau, 1)
        assign(self.params, flat(self.params) + update)
        self.anchor += update
        self.stats.staleness.append(tau)
        self.stats.last_staleness = tau
        self.events.append(("apply", boundary, e.r, tau))

    def end_epoch(self) -> None:
        self.local_steps = 0  # an epoch holds whole rounds; the period may change for the next one
        if self.single_group:
            if self.group_size > 1:
                average_model(self.channel, self.buffers + self.local_buffers, self.stats)
            return
        self._apply_due(final=True)
        average_model(self.channel, self.params + self.buffers, self.stats)
        site_average(self.channel, self.local_buffers)
        self.events.append(("average", self.rounds - 1))
        self.anchor = flat(self.params).clone()

    def sync_state(self) -> dict[str, Any]:
        # Groups step their own optimizers: each rank's moments differ from rank 0's, so they travel too.
        state: dict[str, Any] = {"rounds": self.rounds, "optimizer": self.base.state_dict()}
        if self.local:
            state["local"] = {k: v.detach().clone() for k, v in self.local.items()}
        if self.coded is not None:
            state["delta"] = self.coded.state_dict()
        if self.average.fixed is not None:
            state["grad"] = self.average.fixed.state_dict()
        return state

    def load_sync_state(self, state: dict[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))
        load_local(self.local, state)
        if state.get("optimizer"):
            self.base.load_state_dict(state["optimizer"])
        if self.coded is not None and state.get("delta"):
            self.coded.load_state_dict(state["delta"])
        if self.average.fixed is not None and state.get("grad"):
            self.average.fixed.load_state_dict(state["grad"])
        self.anchor = flat(self.params).clone()


class LocalSGD(SyncedOptimizer):
    """``local-sgd``: independent steps; every ``period`` steps all ranks average w and the buffers."""

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

    def step(self) -> None:
        self.optimizer.step()
        self.stats.steps += 1
        if self.stats.steps % self.period == 0:
            before = self.stats.wan_wait_s
            average_model(self.channel, self.params + self.buffers, self.stats)
            site_average(self.channel, self.local_params + self.local_buffers)
            self.stats.step_wan_s = self.stats.wan_wait_s - before
        else:
            self.stats.step_wan_s = 0.0

    def end_epoch(self) -> None:
        average_model(self.channel, self.params + self.buffers, self.stats)
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


def load_local(local: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    """Restore a site's own normalisation tensors from a checkpointed sync state (when it has them)."""
    saved = state.get("local") or {}
    with torch.no_grad():
        for name, t in local.items():
            if name in saved:
                t.copy_(saved[name])


def decode_layers(buf: torch.Tensor, sizes: list[int], bits: int) -> torch.Tensor:
    """Decode a concatenation of per-layer encodings into one flat float32 vector."""
    out, offset = [], 0
    for n in sizes:
        size = encoded_nbytes(n, bits)
        out.append(decode(buf[offset : offset + size], bits, n))
        offset += size
    return torch.cat(out)
