"""Compressed allreduce over a group of workers (DeepSpeed 1-bit Adam's scheme, fixed-bit codes).

The group is a Horovod process set (``process_set=``, bsp) or a ``torch.distributed`` group
(``transport=`` a :class:`~medseg.distributed.comm.transports.TorchTransport`, gssp's in-site average); the
maths and the byte accounting below are the same on both.

:class:`CompressedAllreduce` averages a dict of float tensors over the ``N`` workers of a process set
while every worker sends about ``2 (N-1)/N * bits/8`` bytes per element, a cost that does not grow
with ``N``. Plain ring allreduce of float32 sends ``2 (N-1)/N * 4`` bytes per element.

Steps for one call, seen from the worker with index ``i`` in the process set (``0 <= i < N``):

1. *Small tensors* (``numel < min_numel``) are flattened into one float32 buffer and averaged
   exactly by one ``hvd.allreduce(op=Average)``: their codes would cost more in scales and launches
   than they save.
2. *Large tensors*: each layer ``L`` is flattened and cut into ``N`` near-equal chunks
   (:func:`~medseg.distributed.comm.compression.split_sizes`); chunk ``j`` is owned by worker ``j``.
   First error feedback, residual ``e1[L]`` on the whole layer::

       v = x_L + e1[L];   enc_j = encode(chunk j of v)  (own scale per chunk);   e1[L] = v - decode(enc)

3. One ``hvd.alltoall`` of uint8: worker ``i`` sends ``enc_j`` of every layer to worker ``j`` and
   receives from every worker ``r`` the encodings of its own chunk ``i``.
4. Worker ``i`` decodes the ``N`` received encodings and averages them (summed in rank order)::

       a[L] = (1/N) sum_r decode(enc_{r,i}[L])

   and compresses the average with a second error feedback, residual ``e2[L]`` on its own chunk::

       w = a[L] + e2[L];   g_i[L] = encode(w);   e2[L] = w - decode(g_i[L])

5. One ``hvd.allgather`` of uint8 (blocks may differ in size by a few bytes) gives every worker every
   ``g_j[L]``; every worker decodes them and reassembles each layer, so all workers hold bit-identical
   results (also the owner of a chunk uses the decoded ``g_i``, not ``a``).

With both residuals the running sum of the results over calls tracks the running sum of the exact
averages up to ``-(mean_r e1_r + e2)`` (one residual of each stage; see
:class:`~medseg.distributed.comm.compression.ErrorFeedback`). With ``N = 1`` the inputs are returned
unchanged and nothing is sent.

Checked scales: before anything received is decoded, each sender's chunk scales (one float32 per
layer, in step 4 from every worker, in step 5 from every chunk's owner) pass the norm rule of
:mod:`medseg.distributed.comm.checks` as one vector per sender: finite, not negative, and its norm
within K times that sender's recent ones or this worker's own. A decoded value is at most its
scale in size, so this bounds what any worker can add to the average; a failing worker is named and
nothing is returned.

Byte accounting (:attr:`CompressedAllreduce.last_bytes_sent`): payload bytes this worker puts on the
wire in this call (Horovod's negotiation messages are not counted), with
``b_j = sum_L encoded_nbytes(size of chunk j of L, bits)`` the bytes of worker ``j``'s block:

* alltoall: pairwise, so exactly ``sum_{j != i} b_j`` (what ``i`` sends to the others);
* allgather: Gloo's ``allgatherv`` is a ring in which worker ``i`` sends to ``i + 1`` the blocks
  ``i, i-1, ..., i-N+2``: every block except that of its successor, ``sum_j b_j - b_{(i+1) mod N}``
  (``(N-1) b_i`` when all blocks are equal); on medseg's channel (``TorchTransport``, Gloo's
  allgather of equal blocks) every block is padded to the largest: ``(N-1) max_j b_j``;
* fused small tensors: the ring allreduce model ``2 (N-1)/N * 4 * numel_small``
  (:meth:`CompressedAllreduce.ring_allreduce_bytes`), the same formula used to count plain Horovod
  float32 or float16 allreduce.

Over ranks in several sites, :mod:`medseg.distributed.comm.site_allreduce` runs this scheme once per
shard between one rank of each site, and exact float32 averages inside the sites.

Every worker must call with the same keys, shapes and order of calls (as for any Horovod collective).
A dead peer makes the Horovod ops hang or fail; timeouts are the caller's business, nothing here
waits in a loop of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from medseg.distributed.comm.checks import UpdateGuard, UpdateRefused, check_tensor, refuse_update
from medseg.distributed.comm.compression import (
    DEFAULT,
    SCALE_NBYTES,
    ErrorFeedback,
    check_bits,
    decode,
    encoded_nbytes,
    resolve_clip,
    split_sizes,
)
from medseg.errors import ConfigError

logger = logging.getLogger(__name__)


def _horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigError(
            "compressed allreduce needs Horovod with PyTorch support (`import horovod.torch` failed: "
            f"{exc}); run `make setup`, which builds it with scripts/build_horovod.sh"
        ) from exc
    return hvd


class CompressedAllreduce:
    """Average float tensors over a Horovod process set with ``bits``-bit codes and error feedback.

    State: two :class:`~medseg.distributed.comm.compression.ErrorFeedback` instances, ``stage1`` (residual
    per large layer, whole tensor) and ``stage2`` (residual per large layer, on this worker's chunk).
    See the module docstring for the steps and the byte accounting.

    Args:
        bits: code width, 2, 4 or 8.
        process_set: a Horovod ``ProcessSet`` registered at ``hvd.init(process_sets=[...])`` (or added
            later); None means ``hvd.global_process_set``. This worker must belong to it.
        min_numel: tensors with fewer elements go through the exact fused float32 allreduce.
        clip: clip factor of the quantiser; ``"default"`` takes ``DEFAULT_CLIP[bits]``.
        name: prefix of the Horovod op names; two instances used at the same time need different names.

    Attributes:
        last_bytes_sent: payload bytes this worker sent in the last call (0 for ``N = 1``).
        last_bytes: the same split by op: ``{"alltoall", "allgather", "allreduce"}``.
    """

    def __init__(
        self,
        bits: int,
        process_set: Any = None,
        min_numel: int = 4096,
        clip: float | None | str = DEFAULT,
        name: str = "cmp",
        transport: Any = None,
    ) -> None:
        check_bits(bits)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
            raise ConfigError(f"compressed allreduce: min_numel must be an integer >= 1, got {min_numel!r}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"compressed allreduce: name must be a non-empty string, got {name!r}")
        self.bits = bits
        self.clip = resolve_clip(bits, clip)
        self.min_numel = min_numel
        self.name = name
        if transport is None:
            from medseg.distributed.comm.transports import HorovodTransport

            self._hvd = _horovod()
            self.process_set = self._hvd.global_process_set if process_set is None else process_set
            transport = HorovodTransport(self._hvd, self.process_set)
        else:
            self._hvd, self.process_set = None, None
        self.transport = transport
        self.stage1 = ErrorFeedback(bits, self.clip)
        self.stage2 = ErrorFeedback(bits, self.clip)
        self.scale_guards = (
            UpdateGuard(f"compressed chunk scales ({name}, step 4)"),
            UpdateGuard(f"compressed chunk scales ({name}, step 5)"),
        )
        self.last_bytes_sent: float = 0.0
        self.last_bytes: dict[str, float] = {"alltoall": 0.0, "allgather": 0.0, "allreduce": 0.0}

    @staticmethod
    def ring_allreduce_bytes(numel: int, elem_size: int, n: int) -> float:
        """Bytes one worker sends in a ring allreduce of ``numel`` elements: ``2 (n-1)/n * elem_size * numel``.

        (Reduce-scatter then allgather, each ``n - 1`` steps of ``numel / n`` elements.) Use it to
        count plain Horovod allreduce: ``elem_size`` 4 for float32, 2 for float16.
        """
        if n < 1:
            raise ConfigError(f"ring_allreduce_bytes: n must be >= 1, got {n}")
        return 2.0 * (n - 1) / n * elem_size * numel

    def block_nbytes(self, numels: list[int], n: int) -> list[int]:
        """``b_j`` for ``j < n``: bytes of the encodings of chunk ``j`` of every layer of ``numels``."""
        sizes = [split_sizes(numel, n) for numel in numels]
        return [sum(encoded_nbytes(s[j], self.bits) for s in sizes) for j in range(n)]

    def expected_bytes(
        self, large_numels: list[int], small_numel: int, n: int, index: int
    ) -> dict[str, float]:
        """The byte accounting of one call, from sizes alone (see the module docstring)."""
        if n == 1:
            return {"alltoall": 0.0, "allgather": 0.0, "allreduce": 0.0}
        blocks = self.block_nbytes(large_numels, n) if large_numels else [0] * n
        if getattr(self.transport, "pads_allgather", False):  # every block padded to the largest
            allgather = float((n - 1) * max(blocks))
        else:
            allgather = float(sum(blocks) - blocks[(index + 1) % n])
        return {
            "alltoall": float(sum(b for j, b in enumerate(blocks) if j != index)),
            "allgather": allgather,
            "allreduce": self.ring_allreduce_bytes(small_numel, 4, n) if small_numel else 0.0,
        }

    def reset(self) -> None:
        """Forget both error-feedback residuals (after a model reload)."""
        self.stage1.reset()
        self.stage2.reset()

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """Both residuals (this worker's own), for checkpoints: a resumed run continues them."""
        return {"stage1": self.stage1.state_dict(), "stage2": self.stage2.state_dict()}

    def load_state_dict(self, state: dict[str, dict[str, Tensor]]) -> None:
        self.stage1.load_state_dict(state["stage1"])
        self.stage2.load_state_dict(state["stage2"])

    def _set_geometry(self) -> tuple[int, int]:
        if self.process_set is None:
            return self.transport.size(), self.transport.index()
        ps = self.process_set
        n = ps.size()
        if n is None:
            raise ConfigError(
                f"compressed allreduce {self.name!r}: process set {ps} is not initialised; call hvd.init() "
                "first and register the set with hvd.init(process_sets=[...]) or hvd.add_process_set()"
            )
        if ps.included() is False:
            raise ConfigError(
                f"compressed allreduce {self.name!r}: this worker (rank {self._hvd.rank()}) is not in "
                f"process set {ps.ranks}; only its members may call it"
            )
        return n, ps.rank()

    def __call__(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Return the averages of ``tensors`` over the process set: same keys, shapes, dtypes, devices."""
        for key, t in tensors.items():
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise ConfigError(f"compressed allreduce: {key!r} must be a floating-point tensor")
        n, index = self._set_geometry()
        if n == 1:
            self.last_bytes = {"alltoall": 0.0, "allgather": 0.0, "allreduce": 0.0}
            self.last_bytes_sent = 0.0
            return dict(tensors)

        small = [k for k, t in tensors.items() if t.numel() < self.min_numel]
        large = [k for k, t in tensors.items() if t.numel() >= self.min_numel]
        out: dict[str, Tensor] = {}
        if small:
            out.update(self._allreduce_small({k: tensors[k] for k in small}))
        if large:
            out.update(self._compressed({k: tensors[k] for k in large}, n, index))
        self.last_bytes = self.expected_bytes(
            [tensors[k].numel() for k in large], sum(tensors[k].numel() for k in small), n, index
        )
        self.last_bytes_sent = sum(self.last_bytes.values())
        logger.debug(
            "%s: %d compressed and %d fused tensors over %d workers, %.0f bytes sent %s",
            self.name,
            len(large),
            len(small),
            n,
            self.last_bytes_sent,
            self.last_bytes,
        )
        return {k: out[k] for k in tensors}

    def describe(self, j: int) -> str:
        """Worker ``j`` of the group as errors name it."""
        describe = getattr(self.transport, "describe", None)
        return describe(j) if describe is not None else f"worker {j}"

    def check_scales(self, buf: Tensor, layout: list[list[int]], index: int, stage: int) -> None:
        """Check every sender's chunk scales in ``buf`` (sender j's encodings have the byte sizes
        ``layout[j]``, back to back) by the norm rule, this worker's own (``index``) the reference."""
        flat = buf.reshape(-1)
        scales, offset = [], 0
        for row in layout:
            mine = []
            for nbytes in row:
                mine.append(flat[offset : offset + SCALE_NBYTES].clone().view(torch.float32)[0])
                offset += nbytes
            scales.append(torch.stack(mine).cpu() if mine else torch.zeros(0))
        sources = [self.describe(j) for j in range(len(layout))]
        for j, s in enumerate(scales):
            if bool((s < 0).any()):
                raise refuse_update(sources[j], self.scale_guards[stage].what, "a chunk scale is negative")
        self.scale_guards[stage].check(scales, sources, own=index, shape=None)

    def _allreduce_small(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors.values()])
        avg = self.transport.allreduce_mean(flat, f"{self.name}.small")
        # a sum does not say who sent what: the exact average of the small tensors must at least be finite
        check_tensor(
            avg,
            "a worker of the group (an allreduce does not say which)",
            f"{self.name} small tensors",
            None,
            None,
        )
        parts = avg.split([t.numel() for t in tensors.values()])
        return {k: p.view(t.shape).to(t.dtype) for (k, t), p in zip(tensors.items(), parts)}

    def _compressed(self, tensors: dict[str, Tensor], n: int, index: int) -> dict[str, Tensor]:
        device = next(iter(tensors.values())).device
        sizes = {k: split_sizes(t.numel(), n) for k, t in tensors.items()}

        # Stage 1: error feedback on the whole layer, one encoding per destination chunk.
        to_dest: list[list[Tensor]] = [[] for _ in range(n)]
        for k, t in tensors.items():
            bufs, _ = self.stage1.compress_chunks(k, t, sizes[k])
            for j in range(n):
                to_dest[j].append(bufs[j])
        send = torch.cat([torch.cat(bufs) for bufs in to_dest])
        splits = [sum(b.numel() for b in bufs) for bufs in to_dest]
        own = {k: encoded_nbytes(sizes[k][index], self.bits) for k in tensors}
        per_source = sum(own.values())
        recv = self.transport.alltoall(send, splits, [per_source] * n, f"{self.name}.alltoall")
        if recv.numel() != n * per_source:
            raise ConfigError(
                f"compressed allreduce {self.name!r}: received {recv.numel()} bytes, expected "
                f"{per_source} from each of {n} workers; do all workers pass the same tensors?"
            )

        self.check_scales(recv, [[own[k] for k in tensors]] * n, index, 0)

        # Average the N decoded copies of this worker's chunk (summed in rank order).
        sums = {k: torch.zeros(sizes[k][index], dtype=torch.float32, device=device) for k in tensors}
        offset = 0
        for _ in range(n):
            for k in tensors:
                sums[k] += decode(recv[offset : offset + own[k]], self.bits, sizes[k][index])
                offset += own[k]

        # Stage 2: error feedback on the averaged chunk, then everyone gathers every chunk.
        mine = torch.cat([self.stage2.compress(k, sums[k] / n)[0] for k in tensors])
        blocks = self.block_nbytes([t.numel() for t in tensors.values()], n)
        gathered = self.transport.allgather(mine, blocks, f"{self.name}.allgather")
        if gathered.numel() != sum(blocks):
            raise ConfigError(
                f"compressed allreduce {self.name!r}: allgather returned {gathered.numel()} bytes, "
                f"expected {sum(blocks)}"
            )
        per_owner = [[encoded_nbytes(sizes[k][j], self.bits) for k in tensors] for j in range(n)]
        self.check_scales(gathered, per_owner, index, 1)
        chunks: dict[str, list[Tensor]] = {k: [] for k in tensors}
        offset = 0
        for j in range(n):
            for k in tensors:
                nb = encoded_nbytes(sizes[k][j], self.bits)
                chunks[k].append(decode(gathered[offset : offset + nb], self.bits, sizes[k][j]))
                offset += nb
        return {k: torch.cat(chunks[k]).view(t.shape).to(t.dtype) for k, t in tensors.items()}


def site_verdict(
    site_group: Any,
    leader: int,
    payload: Tensor | None,
    error: UpdateRefused | None,
    sources: Sequence[str],
    numel: int,
    what: str,
    leader_name: str,
    kind: str = "control",
) -> Tensor:
    """The site leader's checked ``payload`` (``numel`` float32 values) and verdict on every member.

    Members receive ``[payload, verdict]`` in one in-site broadcast (verdict 0: accepted; h + 1: the
    leader refused ``sources[h]``'s part), so a whole site stops with its leader, naming the same
    source, and nobody applies anything. ``site_group`` is None for a site of one rank. Returns the
    payload; raises :class:`UpdateRefused` on a refusal.
    """
    verdict = 0.0 if error is None else float(list(sources).index(error.source) + 1)
    if site_group is not None:
        box = torch.zeros(numel + 1)
        if payload is not None:
            box[:numel] = payload
        box[numel] = verdict
        site_group.broadcast_(box, leader, kind=kind)
        payload, verdict = box[:numel], float(box[numel])
    if error is not None:
        raise error
    if verdict:
        raise refuse_update(
            sources[int(verdict) - 1],
            what,
            f"refused by this site's leader, {leader_name}, whose log has the numbers",
        )
    assert payload is not None
    return payload


class HierarchicalAllreduce:
    """Exact float32 average over ranks in several sites, on medseg's channel (``bsp-hier``).

    ``S`` sites of ``m_s`` ranks, ``N = sum_s m_s``; every call averages a dict of float tensors
    ``x_r`` (flattened into one float32 vector of ``n`` elements) over all ``N`` ranks:

    1. *In the site* (LAN): one ring allreduce (sum) over the site's group,
       ``S_s = sum_{r in s} x_r``.
    2. *Across sites* (WAN): the site leaders (each site's lowest rank) allgather their ``S_s``.
       Every leader checks every site's mean ``S_s / m_s`` by the norm rule of
       :mod:`medseg.distributed.comm.checks` (its own site's mean the reference) and forms
       ``x̄ = (1/N) sum_s S_s``, summed in site order, so every leader holds the same bits.
    3. *In the site* (LAN): the leader broadcasts ``[x̄, verdict]`` to its members
       (:func:`site_verdict`): every rank of every site holds the same ``x̄`` or stops on the same
       refusal.

    ``x̄`` is the rank-weighted mean that plain Horovod's ``hvd.Average`` computes; only the order of
    the float32 additions differs (tests/distributed/mp/peers_replay.py compares the two).
    An allgather rather than an allreduce between the leaders, so that each site's part can be
    checked and a failing site named (as :func:`medseg.distributed.sync.common.average_model` does).

    Byte model (this worker, one call; :attr:`last_bytes`): ``site_allreduce``
    ``2 (m_s-1)/m_s * 4n`` (ring); ``leaders_allgather`` ``(S-1) * 4n`` on a leader (ring allgather:
    it forwards every other site's block once), the only bytes that cross between sites;
    ``site_broadcast`` ``(m_s-1) * 4(n+1)`` on a leader (one copy to each member). Over the job the
    WAN carries ``S (S-1) * 4n`` per call, against ``S * 2 (N-1)/N * 4n`` for a flat float32 ring
    over sites of contiguous ranks (12n at 2 sites x 2 ranks; 8n here).

    Args:
        sites: the ranks of each site (global rank numbers, each rank in exactly one site).
        rank: this worker's global rank.
        make_group: ``make_group(tag, ranks)``, :meth:`medseg.distributed.comm.channel.Channel.make_group`.
        name: prefix of the groups' store tags (unique in the job).
        describe: how errors name a global rank (``rank 2 (site b)``).
    """

    STEPS = ("site_allreduce", "leaders_allgather", "site_broadcast")

    def __init__(
        self,
        sites: Sequence[Sequence[int]],
        rank: int,
        make_group: Callable[[str, list[int]], Any],
        name: str = "hier",
        describe: Callable[[int], str] | None = None,
    ) -> None:
        self.sites = [sorted(int(r) for r in s) for s in sites]
        everyone = [r for s in self.sites for r in s]
        if not self.sites or any(not s for s in self.sites) or len(set(everyone)) != len(everyone):
            raise ConfigError(f"hierarchical allreduce: sites {self.sites} must partition the ranks")
        if rank not in everyone:
            raise ConfigError(f"hierarchical allreduce: rank {rank} is in none of the sites {self.sites}")
        self.rank, self.n = rank, len(everyone)
        self.describe = describe or (lambda r: f"rank {r}")
        self.site_index = next(k for k, s in enumerate(self.sites) if rank in s)
        site = self.sites[self.site_index]
        self.m, self.leader = len(site), site[0]
        self.site_group = make_group(f"{name}/site{'-'.join(map(str, site))}/", site) if self.m > 1 else None
        leaders = [s[0] for s in self.sites]
        self.leaders_group = (
            make_group(f"{name}/leaders/", leaders) if rank == self.leader and len(self.sites) > 1 else None
        )
        self.sources = [self.describe(r) for r in leaders]
        self.guards: dict[str, UpdateGuard] = {}
        self.last_bytes: dict[str, float] = dict.fromkeys(self.STEPS, 0.0)
        self.last_bytes_sent = self.last_lan_bytes = self.last_wan_bytes = 0.0

    def expected_bytes(self, numel: int) -> dict[str, float]:
        """This worker's bytes per step of one call of ``numel`` elements (class docstring)."""
        out = dict.fromkeys(self.STEPS, 0.0)
        if self.m > 1:
            out["site_allreduce"] = CompressedAllreduce.ring_allreduce_bytes(numel, 4, self.m)
        if self.rank == self.leader:
            out["leaders_allgather"] = float((len(self.sites) - 1) * 4 * numel)
            out["site_broadcast"] = float((self.m - 1) * 4 * (numel + 1))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}  # exact: no residuals

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (exact averages keep no state)."""

    def __call__(
        self, tensors: Mapping[str, Tensor], kind: str = "gradients", what: str = "gradients"
    ) -> dict[str, Tensor]:
        """The average of ``tensors`` over every rank: same keys, shapes and dtypes.

        ``kind`` names the buffers for the audit (:mod:`medseg.distributed.comm.audit`); ``what`` names
        them in a refusal, and each ``what`` keeps its own history of accepted norms.
        """
        for key, t in tensors.items():
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise ConfigError(f"hierarchical allreduce: {key!r} must be a floating-point tensor")
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors.values()])
        if self.site_group is not None:  # 1.
            self.site_group.allreduce_(flat, kind=kind)
        total, error = None, None
        if self.rank == self.leader:
            try:
                total = self._across_sites(flat, kind, what) / self.n  # 2.
            except UpdateRefused as exc:
                error = exc
        what_site = f"{what} (a site's mean)"
        leader_name = self.describe(self.leader)
        flat = site_verdict(
            self.site_group,
            self.leader,
            total,
            error,
            self.sources,
            flat.numel(),
            what_site,
            leader_name,
            kind,
        )  # 3.
        self.last_bytes = self.expected_bytes(flat.numel())
        self.last_wan_bytes = self.last_bytes["leaders_allgather"]
        self.last_lan_bytes = self.last_bytes["site_allreduce"] + self.last_bytes["site_broadcast"]
        self.last_bytes_sent = self.last_lan_bytes + self.last_wan_bytes
        parts = flat.split([t.numel() for t in tensors.values()])
        return {k: p.view(t.shape).to(t.dtype) for (k, t), p in zip(tensors.items(), parts)}

    def _across_sites(self, site_sum: Tensor, kind: str, what: str) -> Tensor:
        """Step 2 on a leader: every site's sum, checked, added up in site order."""
        if self.leaders_group is None:
            return site_sum
        parts = [torch.empty_like(site_sum) for _ in self.sites]
        self.leaders_group.allgather(parts, site_sum, kind=kind)
        means = [p / len(s) for p, s in zip(parts, self.sites)]
        guard = self.guards.setdefault(what, UpdateGuard(f"{what} (a site's mean)"))
        guard.check(means, self.sources, own=self.site_index, shape=tuple(site_sum.shape))
        total = torch.zeros_like(site_sum)
        for part in parts:
            total += part
        return total
