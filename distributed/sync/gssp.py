"""``gssp`` and ``ssp``: synchronous inside a group, bounded-staleness asynchronous across groups."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from medseg.distributed.comm.channel import Channel
from medseg.distributed.comm.checks import UpdateGuard, UpdateRefused, refuse_update
from medseg.distributed.comm.collectives import CompressedAllreduce
from medseg.distributed.comm.round_codecs import round_codec
from medseg.distributed.comm.transports import TorchTransport
from medseg.distributed.sync.common import (
    ROUND_FLOOR,
    AverageCheck,
    SyncedOptimizer,
    assign,
    average_model,
    flat,
    leaders_verdict,
    load_local,
    ring_allreduce_bytes,
    site_average,
)
from medseg.distributed.sync.outer import OuterNesterov
from medseg.errors import ConfigError


def dc_compensate(
    delta: torch.Tensor, w_now: torch.Tensor, w_then: torch.Tensor, lam: float, lr: float, steps: int = 1
) -> torch.Tensor:
    """DC-ASGD's delay compensation of a model change ``delta`` made by ``steps`` local steps of
    rate ``lr`` from ``w_then``, applied at ``w_now``.

    DC-ASGD compensates a stale gradient as g' = g + λ g⊙g⊙(w_now − w_then). Reading the change
    as τ steps of one mean gradient, Δ = −η τ ḡ, the compensated change Δ' = −η τ ḡ' is

        Δ' = Δ − λ/(η τ) · Δ⊙Δ⊙(w_now − w_then).
    """
    if lam == 0.0 or lr <= 0.0:
        return delta
    return delta - (lam / (lr * steps)) * delta * delta * (w_now - w_then)


def reset_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zero the momentum an optimizer keeps per parameter (AdamW's ``exp_avg``, SGD's
    ``momentum_buffer``); second moments and step counts stay."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "momentum_buffer"):
            if isinstance(state.get(key), torch.Tensor):
                state[key].zero_()


def round_coefficients(weights: list[float], steps: list[int] | None, normalize: bool) -> list[float]:
    """k_h of S(r) = Σ_h k_h Δ_h(r): c_h, or c_h τ̄ / τ_h with τ̄ = Σ_h c_h τ_h (FedNova; see
    :class:`GroupStale`)."""
    if not normalize:
        return list(weights)
    if steps is None or len(steps) != len(weights) or min(steps) < 1:
        raise ValueError(f"normalize_steps needs each group's steps per round (>= 1), got {steps}")
    mean_steps = sum(c * t for c, t in zip(weights, steps))
    return [c * mean_steps / t for c, t in zip(weights, steps)]


class GroupAverage:
    """Averages gradients over this rank's group every step, on the group's own process group.

    Every gradient becomes g = (1/|g|) Σ_{r∈g} g_r (a missing gradient counts as zero):

    - ``none``: one float32 allreduce of all gradients, flattened;
    - ``fp16``: the flattened gradients summed in float16, then divided by |g| in float32;
    - ``fixed``: :class:`~medseg.distributed.comm.collectives.CompressedAllreduce` over the
      group's ``torch.distributed`` group (codes for tensors of 1024 elements or more).

    :class:`GroupStale` uses ``none``: in-site links are fast, so the per-step average stays exact.
    Calling it returns the bytes this rank sent (ring allreduce model for ``none`` and ``fp16``).
    """

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


@dataclass
class _Round:
    r: int
    work: Any  # the leaders' async work handle (None on non-leaders)
    buf: Any  # what the work fills: every group's Δ_h (none) or its codes (fixed), in group order
    own: torch.Tensor  # Δ_g(r) as the other groups will see it
    w_then: torch.Tensor | None


class GroupStale(SyncedOptimizer):
    """``gssp`` and ``ssp``: synchronous inside a group, bounded-staleness asynchronous across groups.

    Group-staleness synchronous parallel (Jiang et al., CCGrid 2019, on SSP, Ho et al. 2013);
    ``ssp`` is gssp with one rank per group. Notation as in :mod:`medseg.distributed.sync.common`;
    s is the staleness bound, a the anchor (w right after the group's last submission, not
    counting what was received), c_h the weight of group h: its share of the samples in a round
    (c_h ∝ |h| · period_h, Σ_h c_h = 1; FedAvg's weighting). The leader of a group is its lowest rank.

    1. Every step, inside the group: the gradients are averaged synchronously on the group's own
       process group (:class:`GroupAverage`, exact), so every member holds the same w, and the
       optimizer steps.
    2. Every ``period_g`` steps, at the end of the group's round k, it submits its own change since
       its previous submission, Δ_g(k) = w − a: the leader starts an asynchronous allgather of
       Δ_g(k) over the leaders' group, from which S(k) = Σ_h c_h Δ_h(k) (the groups' weighted mean
       change, summed in group order) is formed once every Δ_h(k) has been checked, and the group
       trains on; a ← w.
    3. The leader then decides how many of the oldest pending rounds to apply now,
       n = max(#completed, #forced), where round r is *forced* when r ≤ k − s, and tells its group
       (an in-site broadcast, so the members stay identical).
    4. For each applied round r the leader waits for every Δ_h(r) (a forced round waits until the
       slowest group has submitted it), checks each (:mod:`medseg.distributed.comm.checks`: finite,
       the model's shape, ||Δ_h|| within K times that site's recent round norms or this site's own
       ||Δ_g(r)||; a refused round stops the job naming the site, and nothing is applied), forms S(r)
       and broadcasts it in its site with its verdict; every member then replaces its own change by
       the mean change, whatever its staleness τ = k − r::

           u = S(r) − Δ_g(r);   w ← w + u;   a ← a + u.

    5. At the end of an epoch every pending round is applied and every rank sets w to the
       consensus z = a_0 + Σ_r S(r) (a_0 the epoch's common start), which it has summed from the
       same S(r) in the same order, so every rank starts the next epoch (and validates) with the same
       w, bit for bit, and no parameter crosses the WAN. Only the float buffers (BatchNorm's running
       statistics) are averaged with the rounds' weights, x ← Σ_h c_h x_h
       (:func:`~medseg.distributed.sync.common.average_model`); with DC-ASGD (below) the groups hold
       no common consensus, and w is averaged with them.

    Consensus is exact at any staleness. Once group g has applied every round up to r,

        w_g = a_0 + Σ_{r' ≤ r} S(r') + Σ_{r' > r} Δ_g(r') + (its steps since its last submission),

    so two groups differ only by the rounds they have not both applied yet, and after the epoch's
    last round every group holds a_0 + Σ_r S(r): the sample-weighted consensus, as in local SGD,
    which an epoch of G groups moves as far as bsp's epoch moves one. With coded rounds (below) Δ_g
    is what the round carried, and w_g = z + e_g − e_g⁰ where e_g is the group's error-feedback
    residual (e_g⁰ at the epoch's start). Setting w ← z at the epoch's end leaves the part not yet
    sent in e_g alone, to be sent by the next round, as error feedback (Seide et al., 2014; Karimireddy
    et al., 2019) intends; averaging the w_g instead would also apply Σ_h c_h (e_h − e_h⁰) to the
    model while e_h still holds it, counting it twice. Adding the other groups' full
    changes instead (u = Σ_h Δ_h − Δ_g, asynchronous SGD's rule) would move the model G times as far
    in the direction all groups share. Stale contributions are not damped: a damping factor that
    depends on the receiver's τ (the staleness-dependent rate η/τ of Zhang et al., IJCAI 2016, which
    an earlier version used for τ ≥ 2) moves each group a different fraction of the way, so the
    groups drift apart until the epoch's average, and that average then weights them by rank
    count, not by c_h. The bound s is what limits staleness here: no change is applied more than s
    rounds late, and τ = 1 is the pipeline itself (a round exchanged while the next computes, what
    ``dist.hide_wan`` arranges on purpose).

    Unequal local steps (``normalize_steps``; FedNova, Wang et al., NeurIPS 2020). A round of group h
    is τ_h = period_h local steps, so Δ_h grows with τ_h and the plain mean S = Σ_h c_h Δ_h leans
    toward the group that takes more steps: on a quadratic F_h = ½||w − m_h||² with step η, a round
    moves Δ_h = (1 − (1 − η)^τ_h)(m_h − w), and the fixed point of S = 0 weights m_h by
    c_h (1 − (1 − η)^τ_h), not by c_h. With normalisation each change counts per local step and is
    rescaled by the round's effective step count τ̄ = Σ_h c_h τ_h::

        S(r) = τ̄ Σ_h c_h Δ_h(r) / τ_h

    whose fixed point weights m_h by c_h (1 − (1 − η)^τ_h)/τ_h ≈ c_h η: the sample-weighted optimum
    Σ_h c_h m_h to first order in η. Every group still applies the same S(r), so consensus stays
    exact; with equal periods it is the plain mean.

    Bounded staleness: no group starts round k + 1 before every group has submitted round k − s, so
    a group never leads the slowest by more than s completed rounds when it starts a round, and
    τ ≤ s.

    Outer optimizer (``outer``; DiLoCo, Douillard et al. 2023). With :class:`~medseg.distributed.sync.outer.OuterNesterov`
    of rate η_o and momentum μ, a round's mean change is a pseudo-gradient −S(r) and every group
    applies the outer step's change instead of S(r) itself::

        b(r) = μ b(r−1) − S(r),   U(r) = −η_o (−S(r) + μ b(r)),   u = U(r) − Δ_g(r),   z ← z + U(r)

    Every group feeds the same S(r) in the same round order, so every group holds the same b and U,
    and consensus stays exact: z = a_0 + Σ_r U(r). η_o = 1, μ = 0 is plain averaging (U = S).

    Delay compensation (``dc_lambda`` = λ > 0; DC-ASGD, Zheng et al., ICML 2017): each other
    group's change Δ_h(r), h ≠ g, is compensated for the delay, site by site, before it enters S(r).
    Its gradients were taken around w_then (this group's w when round r was submitted) and are
    applied at w_now; DC-ASGD uses g + λ g⊙g⊙(w_now − w_then), the diagonal of the outer-product
    approximation of the Hessian. A round is τ_h local steps, read as τ_h steps of one mean
    gradient (Δ_h = −η τ_h ḡ_h), which gives (:func:`dc_compensate`)::

        Δ'_h = Δ_h − λ/(η τ_h) · Δ_h⊙Δ_h⊙(w_now − w_then),   S'(r) = c_g Δ_g + Σ_{h≠g} c_h Δ'_h.

    Each site is compensated on its own, so the quadratic term scales with c_h, not with c_h²
    and cross terms as compensating the weighted sum would. With AdamW the steps are not −η g
    (Adam divides by its second moment), so the compensation is a heuristic there. It depends on
    each group's own w_now − w_then, so with λ > 0 the groups no longer share one consensus and
    the epoch's end averages w (off by default; the real-MR benchmark's measurement is in
    docs/benchmarks.md).

    Optimizer state after a round (``round_momentum``). Applying round r moves a group's model by
    u = S(r) − Δ_g(r), a jump its optimizer did not make. ``keep`` (the default, as DiLoCo keeps its
    inner AdamW state across rounds) leaves the state as it is; ``reset`` zeroes the momentum
    (AdamW's first moment m, SGD's momentum buffer), which points along the group's own path
    before the jump, and keeps AdamW's second moment v and step count: v is a running scale of the
    gradients' size, which a jump does not change, and zeroing it would make the next steps
    lr-sized in every coordinate. The choice is measured on the real-MR benchmark
    (docs/benchmarks.md).

    With ``compression: topk`` a round carries each layer's k largest entries of Δ_g plus a residual
    (:class:`~medseg.distributed.comm.round_codecs.TopkRounds`), decoded and applied exactly as coded
    rounds are below. With ``compression: fixed`` a round travels as fixed-bit codes: every member encodes Δ_g layer
    by layer with the same error-feedback residual (what a round does not carry is added to the
    next; the members' inputs are identical, so are their codes and residuals), the leaders
    ``all_gather`` the G encodings asynchronously, and Δ_g is then the decoded value, the same on
    every rank; each leader decodes every group's change (:func:`~medseg.distributed.comm.round_codecs.decode_layers`; a non-finite chunk
    scale decodes to non-finite values and is refused), checks them as above and forms
    S(r) = Σ_h c_h Δ_h(r) in group order.

    Bytes: a leader sends (G − 1)·4n bytes per float32 round (ring allgather; a ring allreduce of
    the sum would send 2(G − 1)/G·4n, the same for two groups, but would not show which site sent
    what), (G − 1)·(the codec's fixed message length) with codes or top-k. An epoch's end sends only
    the float buffers (none for instance norm), plus w itself with DC-ASGD.

    With one group and s = 0, gssp reduces to synchronous data parallelism: nothing is received
    from other groups (S − Δ_g = 0) and the parameters equal bsp's
    (tests/distributed/mp/gssp_equals_bsp.py). With several groups its result is what a single
    process replaying the logged schedule computes (tests/distributed/mp/gssp_replay.py): every
    engine logs, in ``events``, each round it submitted and each round it applied, at which round
    boundary and with which τ.

    Args:
        optimizer: the torch optimizer of this rank (each group steps its own).
        model: the model; its parameters requiring gradients form w.
        channel: medseg's channel, with the groups set (this rank's group, the leaders' group).
        period: period_g, steps per round of this rank's group.
        staleness: s, the staleness bound in rounds.
        dc_lambda: λ of DC-ASGD; 0 applies the rounds uncompensated.
        compression: ``"none"`` (float32 rounds), ``"fixed"`` (coded rounds) or ``"topk"`` (each
            layer's largest entries, :mod:`~medseg.distributed.comm.round_codecs`).
        bits: bits per code with ``"fixed"``.
        on_event: called on the leader with a record at each submission and each round start.
        exchange: run the cross-group exchange (default: when there are several groups).
        local_norm: keep the normalisation layers in the site (FedBN, see
            :mod:`medseg.distributed.sync.common`).
        weights: the groups' unnormalised c_h, one per group (default: equal).
        steps: each group's local steps per round, τ_h (for ``normalize_steps``; default: equal).
        normalize_steps: count each group's change per local step (FedNova, above).
        topk_fraction: f, the share of each layer's entries a ``"topk"`` round sends.
        topk_bits: bits per kept value with ``"topk"`` (0: float32 values).
        outer: the outer optimizer the rounds' mean changes go through (None: applied as they are).
        reset_momentum: zero the optimizer's momentum whenever a round moves the model (below).
    """

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
        topk_fraction: float = 0.01,
        topk_bits: int = 0,
        steps: list[int] | None = None,
        normalize_steps: bool = False,
        outer: OuterNesterov | None = None,
        reset_momentum: bool = False,
    ) -> None:
        super().__init__(optimizer, model, local_norm)
        self.zeroes_momentum = reset_momentum
        if outer is not None and dc_lambda:
            raise ConfigError(
                "gssp: an outer optimizer and DC-ASGD do not combine (DC leaves no common consensus)"
            )
        self.outer = outer
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
        # k_h: what group h's change counts for in S(r): c_h, or c_h τ̄ / τ_h when normalised
        self.coeffs = round_coefficients(self.weights, steps, normalize_steps)
        self.group_steps = list(steps) if steps is not None else [period] * self.n_groups  # τ_h
        # With one group there is nobody to exchange with; ``exchange=True`` runs the machinery anyway (tests).
        self.single_group = not (self.n_groups > 1 if exchange is None else exchange)
        self.on_event = on_event or (lambda record: None)
        self.local_steps = 0
        self.rounds = 0  # rounds submitted by this group
        self.anchor = flat(self.params).clone()
        self.consensus = self.anchor.clone()  # z = a_0 + Σ of the S(r) applied this epoch
        self.pending: collections.deque[_Round] = collections.deque()
        self.layer_sizes = [p.numel() for p in self.params]
        self.coded = round_codec(compression, self.layer_sizes, bits, topk_fraction, topk_bits)
        # checks on what the other sites send (medseg.distributed.comm.checks)
        self.group_index = channel.groups.index(channel.group)
        self.sources = [channel.describe(g[0]) for g in channel.groups]
        self.round_guard = UpdateGuard("cross-site round")
        # with DC-ASGD the groups hold no common consensus: w is averaged with the buffers
        self.averaged = (self.params if dc_lambda else []) + self.buffers
        self.average_check = AverageCheck(channel, self.averaged, "part of the epoch-end average")

    # -- per step -------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        # taken as the step begins: a round in flight then overlaps this step's compute, even if it
        # lands before step() is called
        self.stats.inflight = self.leader and any(not e.work.is_completed() for e in self.pending)
        super().zero_grad(set_to_none)

    def step(self) -> None:
        tic = time.perf_counter()
        self.stats.bytes_sent += self.average()
        self.stats.step_site_s = time.perf_counter() - tic
        self.stats.site_s += self.stats.step_site_s
        self.stats.step_wan_s = 0.0
        self.check_step()  # a diverged loss stops here, before it is stepped or sent
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
                buf = [torch.empty_like(own) for _ in range(self.n_groups)]
                work = self.channel.leaders_pg.allgather(buf, own, async_op=True, kind="model-change")
                self._count_leaders((self.n_groups - 1) * self.numel * 4)  # ring allgather
        else:
            mine, own = self.coded.encode(own)
            if self.leader:
                buf = [torch.empty_like(mine) for _ in range(self.n_groups)]
                work = self.channel.leaders_pg.allgather(buf, mine, async_op=True, kind="model-change")
                self._count_leaders((self.n_groups - 1) * self.coded.nbytes)  # ring allgather
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
        """S(r) = Σ_h c_h Δ_h(r): the leader waits for every Δ_h(r), checks them, and its group
        receives S(r) with the verdict in-site (:func:`~medseg.distributed.sync.common.leaders_verdict`)."""
        total, error = None, None
        if self.leader:
            e.work.wait()
            try:
                total = self._checked_mean(e)
            except UpdateRefused as exc:
                error = exc
        return leaders_verdict(self.channel, total, error, self.sources, self.numel, "cross-site round")

    def _changes(self, e: _Round) -> list[torch.Tensor]:
        """Every group's Δ_h(r) as received (decoded with ``compression: fixed`` or ``topk``); a message
        that does not decode is refused, naming its site."""
        if self.coded is None:
            return list(e.buf)
        changes = []
        for h, message in enumerate(e.buf):
            try:
                changes.append(self.coded.decode(message))
            except (ValueError, ConfigError) as exc:
                raise refuse_update(self.sources[h], "cross-site round", str(exc)) from None
        return changes

    def _checked_mean(self, e: _Round) -> torch.Tensor:
        """S(r) from every group's checked Δ_h(r), in group order; UpdateRefused names a failing site."""
        changes = self._changes(e)
        floor = ROUND_FLOOR * float(self.anchor.norm())
        self.round_guard.check(changes, self.sources, own=self.group_index, shape=(self.numel,), floor=floor)
        total = torch.zeros(self.numel)
        compensate = bool(self.dc_lambda) and e.w_then is not None
        if compensate:
            w_now, lr = flat(self.params), float(self.base.param_groups[0]["lr"])
        for h, delta in enumerate(changes):
            if compensate and h != self.group_index:
                delta = dc_compensate(delta, w_now, e.w_then, self.dc_lambda, lr, self.group_steps[h])
            total += self.coeffs[h] * delta
        return total

    def _apply(self, e: _Round, boundary: int) -> None:
        mean = self._received(e)
        if self.outer is not None:  # U(r): the outer step's change from z
            mean = self.outer.step(self.consensus, -mean) - self.consensus
        self.consensus += mean  # with DC-ASGD not a common z (each leader compensates on its own)
        tau = self.rounds - 1 - e.r
        update = mean - e.own
        assign(self.params, flat(self.params) + update)
        if self.zeroes_momentum:
            reset_momentum(self.base)
        self.anchor += update
        self.stats.staleness.append(tau)
        self.stats.last_staleness = tau
        self.events.append(("apply", boundary, e.r, tau))

    def end_epoch(self) -> None:
        unsent, self.local_steps = self.local_steps % self.period, 0  # the period may change next epoch
        if self.single_group:
            if self.group_size > 1:
                average_model(self.channel, self.buffers + self.local_buffers, self.stats)
            return
        if unsent:
            # w ← z would drop these steps: the epoch's share (groups.static_share, site_data.site_share)
            # gives every group whole rounds, so this is a caller's error, not a site's
            raise RuntimeError(f"gssp: the epoch ended {unsent} steps into a round of {self.period}")
        self._apply_due(final=True)
        if not self.dc_lambda:
            assign(self.params, self.consensus)
        average_model(self.channel, self.averaged, self.stats, self.average_check, self.weights)
        site_average(self.channel, self.local_buffers)
        self.events.append(("average", self.rounds - 1))
        self.anchor = flat(self.params).clone()
        self.consensus = self.anchor.clone()

    def sync_state(self) -> dict[str, Any]:
        # Groups step their own optimizers: each rank's moments differ from rank 0's, so they travel too.
        state: dict[str, Any] = {"rounds": self.rounds, "optimizer": self.base.state_dict()}
        if self.local:
            state["local"] = {k: v.detach().clone() for k, v in self.local.items()}
        if self.coded is not None:
            state["delta"] = self.coded.state_dict()
        if self.average.fixed is not None:
            state["grad"] = self.average.fixed.state_dict()
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
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
        if self.outer is not None:
            self.outer.load_state_dict(state.get("outer") or {})
        self.anchor = flat(self.params).clone()
        self.consensus = self.anchor.clone()
