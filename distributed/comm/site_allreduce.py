"""Compressed allreduce over ranks in several sites: exact inside a site, fixed-bit codes across.

bsp runs it with ``compression: fixed`` when the ranks sit in two or more sites. Over ranks spread
across sites the flat scheme (:mod:`medseg.distributed.comm.collectives`) sends most of its bytes
across the WAN: with sites ``{0,1}`` and ``{2,3}`` each worker's alltoall sends 2 of its 3
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
   :class:`CompressedAllreduce` over the column ``C_j`` (the flat scheme, on medseg's Gloo
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
half in the allgather), 1/12 of float32 ring allreduce's ``12 n``, a little more when part of
the model sits in tensors under ``min_numel`` elements, which travel as float32
(tests/distributed/mp/hier_allreduce.py checks the bound). Sites of unequal size work as they are: a rank of a smaller site owns
several shards and takes part in several columns, one after another in shard order (every column's
members meet there in the same order, so nothing waits in a cycle). With one site there is no WAN
and bsp keeps the flat scheme.


As for :class:`~medseg.distributed.comm.collectives.CompressedAllreduce`, every worker must call with
the same keys, shapes and order of calls; timeouts are the caller's business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from medseg.distributed.comm.checks import check_tensor
from medseg.distributed.comm.collectives import CompressedAllreduce
from medseg.distributed.comm.compression import DEFAULT, check_bits, encoded_nbytes, resolve_clip, split_sizes
from medseg.errors import ConfigError


def _torch_transport(group: Any) -> Any:
    from medseg.distributed.comm.transports import TorchTransport

    return TorchTransport(group)


class HierarchicalCompressedAllreduce:
    """Average float tensors over ranks in several sites: exact inside a site, ``bits``-bit codes across.

    See the module docstring for the steps, the maths and the byte formulas.

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
            per_local = self._per_local([sum(sz[j] for sz in large_sizes) + small_sizes[j] for j in range(k)])
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
        cut = _Cut.of(tensors, self.threshold(), self.n_shards)
        flat = torch.cat([tensors[key].detach().reshape(-1).to(torch.float32) for key in cut.order])
        flat = self._site_mean(flat)  # 1.
        block = self._across_sites(flat, cut)  # 2.
        per_local = self._per_local(cut.shard_numels())
        if self.site_group is not None:  # 3.
            gathered = _torch_transport(self.site_group).allgather(block, per_local, f"{self.name}.site")
        else:
            gathered = block
        out = self._reassemble(gathered.split(per_local), cut, tensors)
        self.last_bytes = self.expected_bytes([tensors[key].numel() for key in cut.large], cut.small_numel)
        self.last_lan_bytes = self.last_bytes["site_allreduce"] + self.last_bytes["site_allgather"]
        self.last_wan_bytes = sum(self.last_bytes[s] for s in self.STEPS if s.startswith("cross"))
        self.last_bytes_sent = self.last_lan_bytes + self.last_wan_bytes
        return {key: out[key] for key in tensors}

    def _site_mean(self, flat: Tensor) -> Tensor:
        """Step 1: exact site mean (float32 ring allreduce on the site's LAN), weighted by the site's share."""
        if self.site_group is not None:
            self.site_group.allreduce_(flat, kind="gradients")
        factor = self.weight / self.m
        if factor != 1.0:
            flat = flat * factor
        return flat

    def _across_sites(self, flat: Tensor, cut: _Cut) -> Tensor:
        """Step 2: each owned shard across sites, codes for the large layers, float32 for the small
        ones; returns this rank's shards, concatenated in shard order."""
        pieces = dict(zip(cut.order, flat.split(cut.numels)))
        small_parts = flat[sum(cut.numels[: len(cut.large)]) :].split(cut.small_sizes)
        mine: list[Tensor] = []
        for j in self.owned:
            col = self.columns[j]
            shard = {key: pieces[key].split(cut.large_sizes[key])[j] for key in cut.large}
            done = col(shard) if shard else {}
            part = small_parts[j]
            if part.numel() and self.n_sites > 1:
                part = col.transport.allreduce_mean(part.contiguous(), f"{self.name}.col{j}.small")
                check_tensor(
                    part,
                    f"a rank of {self.column_ranks[j]} (an allreduce does not say which)",
                    f"{self.name} small tensors, shard {j}",
                    None,
                    None,
                )
            mine += [done[key].reshape(-1) for key in cut.large] + [part]
        return torch.cat(mine) if mine else torch.zeros(0)

    def _per_local(self, shard_numels: list[int]) -> list[int]:
        """Elements each local rank of the site holds after step 2: the sum of the shards it owns."""
        return [
            sum(shard_numels[j] for j in range(self.n_shards) if j % self.m == owner)
            for owner in range(self.m)
        ]

    def _reassemble(
        self, blocks: Sequence[Tensor], cut: _Cut, tensors: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Step 3's result (every local rank's shards) back into tensors of the callers' shapes and dtypes."""
        k = self.n_shards
        chunks: dict[str, list[Tensor | None]] = {key: [None] * k for key in cut.large}
        small_chunks: list[Tensor | None] = [None] * k
        for owner in range(self.m):
            offset = 0
            for j in range(k):
                if j % self.m != owner:
                    continue
                for key in cut.large:
                    n = cut.large_sizes[key][j]
                    chunks[key][j] = blocks[owner][offset : offset + n]
                    offset += n
                small_chunks[j] = blocks[owner][offset : offset + cut.small_sizes[j]]
                offset += cut.small_sizes[j]
        out: dict[str, Tensor] = {}
        for key in cut.large:
            t = tensors[key]
            out[key] = torch.cat(chunks[key]).view(t.shape).to(t.dtype)
        if cut.small:
            small_out = torch.cat(small_chunks).split(cut.numels[len(cut.large) :])
            for key, part in zip(cut.small, small_out):
                t = tensors[key]
                out[key] = part.view(t.shape).to(t.dtype)
        return out


@dataclass
class _Cut:
    """How one call of :class:`HierarchicalCompressedAllreduce` cuts its tensors into ``K`` shards."""

    large: list[str]  # keys of tensors with at least the threshold's elements, cut layer by layer
    small: list[str]  # keys of the others, fused into one vector that is cut as a whole
    numels: list[int]  # elements of every tensor, in the order large + small
    large_sizes: dict[str, list[int]]  # each large tensor's K shard sizes
    small_sizes: list[int]  # the fused small tensors' K shard sizes

    @classmethod
    def of(cls, tensors: Mapping[str, Tensor], threshold: int, k: int) -> _Cut:
        large = [key for key, t in tensors.items() if t.numel() >= threshold]
        small = [key for key, t in tensors.items() if t.numel() < threshold]
        numels = [tensors[key].numel() for key in large + small]
        return cls(
            large,
            small,
            numels,
            {key: split_sizes(tensors[key].numel(), k) for key in large},
            split_sizes(sum(numels[len(large) :]), k),
        )

    @property
    def order(self) -> list[str]:
        return self.large + self.small

    @property
    def small_numel(self) -> int:
        return sum(self.numels[len(self.large) :])

    def shard_numels(self) -> list[int]:
        """Elements of each shard: its part of every large tensor and of the fused small ones."""
        return [
            sum(self.large_sizes[key][j] for key in self.large) + self.small_sizes[j]
            for j in range(len(self.small_sizes))
        ]
