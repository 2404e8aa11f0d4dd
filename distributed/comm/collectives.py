"""Compressed allreduce over a group of workers (DeepSpeed 1-bit Adam's scheme, fixed-bit codes),
flat or site-aware.

The group is a Horovod process set (``process_set=``, bsp) or a ``torch.distributed`` group
(``transport=`` a :class:`~medseg.distributed.comm.channel.TorchTransport`, gssp's in-site average); the
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

Site-aware scheme (:class:`HierarchicalCompressedAllreduce`; bsp with ``compression: fixed`` when the
ranks sit in two or more sites). Over ranks spread across sites the flat scheme sends most of its
bytes across the WAN: with sites ``{0,1}`` and ``{2,3}`` each worker's alltoall sends 2 of its 3
blocks to the other site and the allgather ring crosses on 2 of its 4 edges, about
``3.5 * bits/8`` bytes per gradient element across the WAN in all (1.75 at 4 bits), against
``S * 2 (N-1)/N * 4`` (12) for float32 ring allreduce. The site-aware scheme sends codes across the
WAN once per site and shard instead. ``S`` sites of ``m_s`` ranks (``N = sum_s m_s``) cut every
tensor into ``K = max_s m_s`` shards; shard ``j`` of site ``s`` belongs to its local rank
``j mod m_s``, and the *column* ``C_j = {rank j mod m_s of site s, for every s}`` holds one rank per site.

1. *In the site* (LAN, float32): one ring allreduce of all tensors, flattened, over the site's
   ranks, times ``S/N``: ``z_s = (S/N) sum_{r in s} x_r``, so that ``(1/S) sum_s z_s`` is the exact
   mean over all ``N`` ranks (equal sites: ``z_s`` is the site mean; unequal sites: each site weighs
   by its ranks, as bsp does).
2. *Across sites* (WAN), for every shard ``j`` this rank owns: chunk ``j`` (of ``K`` near-equal
   chunks) of every layer with at least ``max(min_numel, K*S)`` elements goes through a
   :class:`CompressedAllreduce` over the column ``C_j`` (the flat scheme above, on medseg's Gloo
   channel, with this column's own two error-feedback residuals); chunk ``j`` of the fused small
   tensors is averaged exactly (float32 ring allreduce over ``C_j``). Both return
   ``(1/S) sum_s chunk_j(z_s)``, the global mean of that shard (coded, for the large layers), the
   same bits on every member of the column.
3. *In the site* (LAN, float32): a ring allgather of every rank's shards, so every rank of every
   site holds the same bits.

Every element passes through exactly one column, so the error-feedback invariant holds shard by
shard: the running sum of the results tracks the running sum of the exact means up to
``-(mean_{r in C_j} e1_r + e2)`` (``e1_r``: the stage-1 residual of column member ``r`` on its chunk
``j``; ``e2``: the stage-2 residuals of the column's members, each on its sub-chunk). The in-site
steps are exact, so they add float32 rounding only.

Byte accounting (:attr:`HierarchicalCompressedAllreduce.last_bytes`, this worker, one call; ``n``
all elements, ``n_j`` those of shard ``j``, ``b_{j,c}`` the encoded bytes of sub-chunk ``c`` of shard
``j`` over all large layers, ``u_j`` the small tensors' elements in shard ``j``; the channel's
allgather pads every block to the largest):

* LAN, ``site_allreduce``: ``2 (m_s-1)/m_s * 4 n``;
* WAN, per owned shard ``j`` with this rank at position ``i`` in ``C_j``: ``cross_alltoall``
  ``sum_{c != i} b_{j,c}``; ``cross_allgather`` ``(S-1) max_c b_{j,c}``; ``cross_allreduce``
  ``2 (S-1)/S * 4 u_j``;
* LAN, ``site_allgather``: ``(m_s-1) * 4 * max_l sum_{j owned by local rank l} n_j``.

``last_wan_bytes`` is the sum of the ``cross_*`` terms (every member of a column is in another site),
``last_lan_bytes`` the two ``site_*`` terms. At 2 sites x 2 ranks and 4 bits, WAN bytes over all ranks
are about ``n/2`` for the codes (each rank sends half its shard's codes in the alltoall and its own
half in the allgather), 1/12 of float32 ring allreduce's ``12 n``; the benchmark's UNet (137k
parameters, 1375 of them in tensors under 1024 elements, which travel as float32) measures 0.089x
(tests/distributed/mp/hier_allreduce.py). Sites of unequal size work as they are: a rank of a smaller site owns
several shards and takes part in several columns, one after another in shard order (every column's
members meet there in the same order, so nothing waits in a cycle). With one site there is no WAN
and bsp keeps the flat scheme.

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

from medseg.distributed.comm.compression import (
    DEFAULT,
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
            from medseg.distributed.comm.channel import HorovodTransport

            self._hvd = _horovod()
            self.process_set = self._hvd.global_process_set if process_set is None else process_set
            transport = HorovodTransport(self._hvd, self.process_set)
        else:
            self._hvd, self.process_set = None, None
        self.transport = transport
        self.stage1 = ErrorFeedback(bits, self.clip)
        self.stage2 = ErrorFeedback(bits, self.clip)
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

    def _allreduce_small(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors.values()])
        avg = self.transport.allreduce_mean(flat, f"{self.name}.small")
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
        chunks: dict[str, list[Tensor]] = {k: [] for k in tensors}
        offset = 0
        for j in range(n):
            for k in tensors:
                nb = encoded_nbytes(sizes[k][j], self.bits)
                chunks[k].append(decode(gathered[offset : offset + nb], self.bits, sizes[k][j]))
                offset += nb
        return {k: torch.cat(chunks[k]).view(t.shape).to(t.dtype) for k, t in tensors.items()}


def _torch_transport(group: Any) -> Any:
    from medseg.distributed.comm.channel import TorchTransport

    return TorchTransport(group)


class HierarchicalCompressedAllreduce:
    """Average float tensors over ranks in several sites: exact inside a site, ``bits``-bit codes across.

    See the module docstring ("Site-aware scheme") for the steps, the maths and the byte formulas.

    Args:
        bits: code width of the cross-site codes, 2, 4 or 8.
        sites: the ranks of each site (global rank numbers; every rank in exactly one site). Order
            of the sites is the order of their shards' columns; ranks are sorted inside a site.
        rank: this worker's global rank (a member of one of ``sites``).
        make_group: ``make_group(tag, ranks)`` returns a group over ``ranks`` with the methods of
            :class:`medseg.distributed.comm.channel.Group` (``allreduce_``, ``allgather``, ``alltoall``,
            ``size``, ``index``); :meth:`medseg.distributed.comm.channel.Channel.make_group`. It is called
            only for groups this worker is in, in the same order on every member.
        min_numel: tensors with fewer elements (or fewer than shards x sites) travel as float32.
        clip: clip factor of the quantiser (see :class:`CompressedAllreduce`).
        name: prefix of the groups' store keys; two instances in one job need different names.

    Attributes:
        last_bytes_sent: payload bytes this worker sent in the last call.
        last_lan_bytes / last_wan_bytes: of those, to workers of its own site / of other sites.
        last_bytes: the same by step: ``site_allreduce``, ``cross_alltoall``, ``cross_allgather``,
            ``cross_allreduce``, ``site_allgather``.
    """

    def __init__(
        self,
        bits: int,
        sites: Sequence[Sequence[int]],
        rank: int,
        make_group: Callable[[str, list[int]], Any],
        min_numel: int = 4096,
        clip: float | None | str = DEFAULT,
        name: str = "hcmp",
    ) -> None:
        check_bits(bits)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
            raise ConfigError(
                f"hierarchical compressed allreduce: min_numel must be an integer >= 1, got {min_numel!r}"
            )
        self.sites = [sorted(int(r) for r in s) for s in sites]
        everyone = [r for s in self.sites for r in s]
        if not self.sites or any(not s for s in self.sites) or len(set(everyone)) != len(everyone):
            raise ConfigError(
                f"hierarchical compressed allreduce: sites {self.sites} must be non-empty lists of ranks, "
                "each rank in exactly one site"
            )
        if rank not in everyone:
            raise ConfigError(
                f"hierarchical compressed allreduce: rank {rank} is in none of the sites {self.sites}"
            )
        self.bits, self.rank, self.name = bits, rank, name
        self.clip = resolve_clip(bits, clip)
        self.min_numel = min_numel
        self.n = len(everyone)
        self.n_sites = len(self.sites)
        self.site_index = next(k for k, s in enumerate(self.sites) if rank in s)
        site = self.sites[self.site_index]
        self.m = len(site)
        self.local = site.index(rank)
        self.n_shards = max(len(s) for s in self.sites)
        # shard j of a site with m ranks is handled by its local rank j mod m
        self.owned = [j for j in range(self.n_shards) if j % self.m == self.local]
        self.weight = self.m * self.n_sites / self.n  # site mean -> its share of the global mean
        self.site_group = make_group(f"{name}/site{'-'.join(map(str, site))}/", site) if self.m > 1 else None
        self.columns: dict[int, CompressedAllreduce] = {}
        self.column_ranks: dict[int, list[int]] = {}
        for j in self.owned:
            ranks = self.column_of(j)
            self.column_ranks[j] = ranks
            group = make_group(f"{name}/col{j}/", ranks)
            self.columns[j] = CompressedAllreduce(
                bits, min_numel=1, clip=clip, name=f"{name}.col{j}", transport=_torch_transport(group)
            )
        self.last_bytes_sent = 0.0
        self.last_lan_bytes = 0.0
        self.last_wan_bytes = 0.0
        self.last_bytes: dict[str, float] = dict.fromkeys(self.STEPS, 0.0)

    STEPS = ("site_allreduce", "cross_alltoall", "cross_allgather", "cross_allreduce", "site_allgather")

    def column_of(self, j: int) -> list[int]:
        """The ranks that exchange shard ``j`` across sites: one per site, ``site[j mod |site|]``."""
        return sorted(s[j % len(s)] for s in self.sites)

    def threshold(self) -> int:
        """Fewer elements than this travel exactly (float32); at least one per sub-chunk of every shard."""
        return max(self.min_numel, self.n_shards * self.n_sites)

    def expected_bytes(self, large_numels: list[int], small_numel: int) -> dict[str, float]:
        """This worker's bytes per step of one call, from the sizes alone (module docstring)."""
        k, s = self.n_shards, self.n_sites
        total = sum(large_numels) + small_numel
        small_sizes = split_sizes(small_numel, k)
        large_sizes = [split_sizes(n, k) for n in large_numels]
        out = dict.fromkeys(self.STEPS, 0.0)
        out["site_allreduce"] = (
            CompressedAllreduce.ring_allreduce_bytes(total, 4, self.m) if self.m > 1 else 0.0
        )
        if s > 1:
            for j in self.owned:
                index = self.column_of(j).index(self.rank)
                shard = [sz[j] for sz in large_sizes]
                blocks = [
                    sum(encoded_nbytes(split_sizes(n, s)[c], self.bits) for n in shard) for c in range(s)
                ]
                if shard:
                    out["cross_alltoall"] += float(sum(b for c, b in enumerate(blocks) if c != index))
                    out["cross_allgather"] += float((s - 1) * max(blocks))  # padded ring allgather
                if small_sizes[j]:
                    out["cross_allreduce"] += CompressedAllreduce.ring_allreduce_bytes(small_sizes[j], 4, s)
        if self.m > 1:
            per_local = [
                sum(
                    sum(sz[j] for sz in large_sizes) + small_sizes[j] for j in range(k) if j % self.m == owner
                )
                for owner in range(self.m)
            ]
            out["site_allgather"] = float((self.m - 1) * 4 * max(per_local))  # padded ring allgather
        return out

    def reset(self) -> None:
        for col in self.columns.values():
            col.reset()

    def state_dict(self) -> dict[str, Any]:
        """Every column's residuals (this worker's own), by shard."""
        return {f"col{j}": col.state_dict() for j, col in self.columns.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for j, col in self.columns.items():
            if f"col{j}" in state:
                col.load_state_dict(state[f"col{j}"])

    def __call__(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The average of ``tensors`` over every rank of every site: same keys, shapes, dtypes."""
        for key, t in tensors.items():
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise ConfigError(
                    f"hierarchical compressed allreduce: {key!r} must be a floating-point tensor"
                )
        k = self.n_shards
        thr = self.threshold()
        large = [key for key, t in tensors.items() if t.numel() >= thr]
        small = [key for key, t in tensors.items() if t.numel() < thr]
        order = large + small
        flat = torch.cat([tensors[key].detach().reshape(-1).to(torch.float32) for key in order])

        # 1. Exact site mean (float32 ring allreduce on the site's LAN), weighted by the site's share.
        if self.site_group is not None:
            self.site_group.allreduce_(flat, kind="gradients")
        factor = self.weight / self.m
        if factor != 1.0:
            flat = flat * factor
        numels = [tensors[key].numel() for key in order]
        pieces = dict(zip(order, flat.split(numels)))
        large_sizes = {key: split_sizes(tensors[key].numel(), k) for key in large}
        small_numel = sum(numels[len(large) :])
        small_sizes = split_sizes(small_numel, k)
        small_flat = flat[sum(numels[: len(large)]) :]
        small_parts = small_flat.split(small_sizes)

        # 2. Each owned shard across sites: codes for the large layers, float32 for the small ones.
        mine: list[Tensor] = []
        for j in self.owned:
            col = self.columns[j]
            shard = {key: pieces[key].split(large_sizes[key])[j] for key in large}
            done = col(shard) if shard else {}
            part = small_parts[j]
            if part.numel() and self.n_sites > 1:
                part = col.transport.allreduce_mean(part.contiguous(), f"{self.name}.col{j}.small")
            mine += [done[key].reshape(-1) for key in large] + [part]
        block = torch.cat(mine) if mine else torch.zeros(0)

        # 3. Every rank of the site gets every shard (float32, LAN).
        per_local = [
            sum(
                sum(large_sizes[key][j] for key in large) + small_sizes[j]
                for j in range(k)
                if j % self.m == owner
            )
            for owner in range(self.m)
        ]
        if self.site_group is not None:
            gathered = _torch_transport(self.site_group).allgather(block, per_local, f"{self.name}.site")
        else:
            gathered = block
        chunks: dict[str, list[Tensor | None]] = {key: [None] * k for key in large}
        small_chunks: list[Tensor | None] = [None] * k
        blocks = gathered.split(per_local)
        for owner in range(self.m):
            offset = 0
            for j in range(k):
                if j % self.m != owner:
                    continue
                for key in large:
                    n = large_sizes[key][j]
                    chunks[key][j] = blocks[owner][offset : offset + n]
                    offset += n
                small_chunks[j] = blocks[owner][offset : offset + small_sizes[j]]
                offset += small_sizes[j]
        out: dict[str, Tensor] = {}
        for key in large:
            t = tensors[key]
            out[key] = torch.cat(chunks[key]).view(t.shape).to(t.dtype)
        if small:
            small_out = torch.cat(small_chunks).split(numels[len(large) :])
            for key, part in zip(small, small_out):
                t = tensors[key]
                out[key] = part.view(t.shape).to(t.dtype)

        self.last_bytes = self.expected_bytes([tensors[key].numel() for key in large], small_numel)
        self.last_lan_bytes = self.last_bytes["site_allreduce"] + self.last_bytes["site_allgather"]
        self.last_wan_bytes = sum(self.last_bytes[s] for s in self.STEPS if s.startswith("cross"))
        self.last_bytes_sent = self.last_lan_bytes + self.last_wan_bytes
        return {key: out[key] for key in tensors}
