"""What every synchronisation strategy shares: flat-vector helpers, the normalisation state a site
keeps to itself, the per-epoch statistics and the optimizer wrapper base class.

Each strategy is an optimizer wrapper (:class:`SyncedOptimizer`) the training loop steps like any
optimizer; its maths is stated in its class docstring:

``bsp``        :class:`medseg.distributed.sync.bsp.BulkSynchronous`
``gssp``       :class:`medseg.distributed.sync.gssp.GroupStale`
``ssp``        :class:`medseg.distributed.sync.gssp.GroupStale` with one rank per group
``local-sgd``  :class:`medseg.distributed.sync.local_sgd.LocalSGD`
``bsp-hier``   :class:`medseg.distributed.sync.bsp.BulkSynchronous` (``hier``: in-site, then leaders)
``fedavg``     :class:`medseg.distributed.sync.peers.FedAvg`
``diloco``     :class:`medseg.distributed.sync.peers.DiLoCo`

Notation: N ranks, partitioned into groups g of |g| ranks (by default one group per host, i.e. per
hospital site); G groups; w the flat parameter vector (:func:`flat`); η the learning rate. One
*round* of group g is ``period_g`` local steps, chosen so that every group completes a round in
about the same wall time (period_g = per-rank speed of g / per-rank speed of the slowest group).
Where each collective runs (Horovod, a site's
``torch.distributed`` group, or the leaders' group) is tabled in
:mod:`medseg.distributed.comm.channel`.

``local_norm`` (FedBN, Li et al., ICLR 2021), for gssp, ssp and local-sgd: the parameters and running
statistics of normalisation layers (:func:`norm_state`) are taken out of w and of the buffers, so no
round, model average or epoch-end buffer average sends them to another site. Inside a site they
stay identical (their gradients are averaged in-site every step like the others', and their running
statistics are averaged in-site at each epoch end, :func:`site_average`), so each site keeps one
model whose shared part is everyone's and whose normalisation is its own.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from medseg.distributed.comm.channel import Channel
from medseg.distributed.comm.checks import UpdateGuard, UpdateRefused, check_gradients, check_tensor
from medseg.distributed.comm.collectives import CompressedAllreduce, site_verdict

log = logging.getLogger(__name__)

ring_allreduce_bytes = CompressedAllreduce.ring_allreduce_bytes


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as one float32 vector, in order (w, given the parameters)."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in tensors])


def assign(tensors: list[torch.Tensor], vector: torch.Tensor) -> None:
    """Copy ``vector`` back into ``tensors`` in place (the inverse of :func:`flat`)."""
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
        self.who = "this rank"  # how errors name this rank (the session sets ``rank 2 (site b)``)

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
        self.check_step()
        self.optimizer.step()
        self.stats.steps += 1

    def check_step(self) -> None:
        """Refuse a step whose gradients are not finite (the training loss was NaN or Inf): nothing is
        stepped, sent or checkpointed after it (:func:`~medseg.distributed.comm.checks.check_gradients`)."""
        check_gradients([p for g in self.base.param_groups for p in g["params"]], self.who)

    def end_epoch(self) -> None:
        """Called by every rank at the end of an epoch (a collective for some strategies)."""


ROUND_FLOOR = 1e-4  # the norm rule's floor for model changes, relative to the model's norm


class AverageCheck:
    """The checks on the sites' parts of a model average (:mod:`medseg.distributed.comm.checks`).

    A site's part is its group mean m_h; what is checked is its change since the last common model
    c (the previous average, or the start): u_h = m_h − c, against this site's own u_own = m_own − c,
    by the norm rule with floor ``ROUND_FLOOR · ||c||``. After every average c becomes the result.
    """

    def __init__(
        self, channel: Channel, tensors: list[torch.Tensor], what: str = "part of the model average"
    ) -> None:
        self.guard = UpdateGuard(what)
        self.sources = [channel.describe(g[0]) for g in channel.groups]
        self.common = flat(tensors).clone() if tensors else torch.zeros(0)

    def __call__(self, parts: list[torch.Tensor], own: int) -> None:
        # a part of the wrong shape or dtype goes to the guard as it is (and is refused there)
        same = [p.shape == self.common.shape and p.dtype == self.common.dtype for p in parts]
        changes = [p - self.common if ok else p for p, ok in zip(parts, same)]
        floor = ROUND_FLOOR * float(self.common.norm())
        self.guard.check(changes, self.sources, own=own, shape=tuple(self.common.shape), floor=floor)


def leaders_verdict(
    channel: Channel,
    payload: torch.Tensor | None,
    error: UpdateRefused | None,
    sources: list[str],
    numel: int,
    what: str,
) -> torch.Tensor:
    """The leader's checked result (``payload``) and verdict to every member of its group.

    Members receive ``[payload, verdict]`` in one in-site broadcast (verdict 0: accepted; h + 1: the
    leader refused group h's part), so every member of the site stops with the leader, naming the
    same site, and none applies anything. Returns the payload; raises on a refusal.
    """
    return site_verdict(
        channel.group_pg if len(channel.group) > 1 else None,
        channel.leader,
        payload if channel.is_leader else None,
        error,
        sources,
        numel,
        what,
        channel.describe(channel.leader),
    )


def one_initial_model(channel: Channel, model: torch.nn.Module) -> bool:
    """One model everywhere: rank 0's parameters and buffers (its checkpoint's on a resume);
    whether rank 0's model had to be broadcast. Every rank calls this.

    Every rank built its model from the same seed (and, on a resume, loaded the same shared
    state), so the models usually agree already: the ranks compare a 16-byte BLAKE2b digest of
    their float tensors first, and rank 0's model crosses the WAN only when a digest differs
    (another torch build, a buffer that profiling changed). Every rank sees every digest, so all
    take the same branch.
    """
    tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
    vector = flat(tensors)
    mine = hashlib.blake2b(vector.numpy().tobytes(), digest_size=16).digest()
    digests = [torch.empty(16, dtype=torch.uint8) for _ in range(channel.size)]
    channel.world.allgather(digests, torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    if all(torch.equal(d, digests[0]) for d in digests):
        return False
    log.info("rank %d: the ranks' initial models differ; rank 0's is broadcast", channel.rank)
    channel.broadcast_tensor(vector)
    check_tensor(vector, channel.describe(0), "initial model", tuple(vector.shape), torch.float32)
    assign(tensors, vector)
    return True


def average_model(
    channel: Channel,
    tensors: list[torch.Tensor],
    stats: StepStats,
    check: AverageCheck | None = None,
    weights: list[float] | None = None,
) -> None:
    """Every rank replaces ``tensors`` by their average over all ranks, x ← (1/N) Σ_r x_r (or, with
    ``weights`` c_h per group summing to 1, the groups' weighted mean Σ_h c_h m_h), one WAN copy per
    group.

    Members average in their group; the leaders allgather their group means m_h, check every site's
    part (``check``, :class:`AverageCheck`), and each forms Σ_h |g_h|·m_h / N (or Σ_h c_h m_h) in
    group order (bit-identical on every leader); each leader broadcasts the result in its group. An allgather rather than an allreduce, so that each site's
    part can be checked and a failing site named: a leader sends (G−1)·4n bytes instead of a ring
    allreduce's 2(G−1)/G·4n (the same for two sites).
    """
    if not tensors:
        return
    tic = time.perf_counter()
    vector = flat(tensors)
    channel.group_mean_(vector)
    if len(channel.groups) > 1:
        error, total = None, None
        if channel.leaders_pg is not None:
            parts = [torch.empty_like(vector) for _ in channel.groups]
            channel.leaders_pg.allgather(parts, vector, kind="parameters")
            sent = (len(channel.groups) - 1) * vector.numel() * 4  # ring allgather
            stats.bytes_sent += sent
            stats.wan_bytes += sent
            try:
                if check is not None:
                    check(parts, channel.groups.index(channel.group))
                total = torch.zeros_like(vector)
                if weights is None:
                    for g, part in zip(channel.groups, parts):
                        total += len(g) * part
                    total /= channel.size
                else:
                    for c, part in zip(weights, parts):
                        total += c * part
            except UpdateRefused as exc:
                error = exc
        sources = check.sources if check is not None else [channel.describe(g[0]) for g in channel.groups]
        vector = leaders_verdict(channel, total, error, sources, vector.numel(), "part of the model average")
    else:
        channel.group_broadcast(vector)
    assign(tensors, vector)
    if check is not None:
        check.common = vector.clone()
    stats.wan_wait_s += time.perf_counter() - tic


def load_local(local: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    """Restore a site's own normalisation tensors from a checkpointed sync state (when it has them)."""
    saved = state.get("local") or {}
    with torch.no_grad():
        for name, t in local.items():
            if name in saved:
                t.copy_(saved[name])
