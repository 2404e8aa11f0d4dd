"""medseg's own collectives beside Horovod: a ``torch.distributed`` Gloo channel per job.

Why a second channel. Horovod runs every CPU (Gloo) collective of a process, whatever its process
set, one after another in one background thread, and each of that thread's cycles first
coordinates every process set, the global one included. So an in-group allreduce waits while a
global ``allreduce_async_`` is pending, and across hospitals every in-site Horovod allreduce pays
the WAN round trip, which a ``torch.distributed`` group of the site does not (the measurements are
in docs/design.md, "Where each collective runs"). An "asynchronous" cross-site exchange on Horovod
therefore stalls the sites, and Horovod process sets do not isolate sites.

So every rank of a launched job also joins a private Gloo job of its own, made from Horovod's rank
and size (rank 0 hosts a ``torch.distributed`` TCP store listening on its own address only and
announces it as a MAC'd JSON message: under ``horovodrun --gloo`` through its rendezvous server,
so the channel is built while ``hvd.init()`` runs (:meth:`Channel.before_horovod`), otherwise with
one Horovod broadcast after it; every value in the store carries a MAC made with the job secret,
:mod:`medseg.distributed.comm.auth`): a world group, its synchronisation group and, on leaders, the
group of the groups' leaders, each a ``ProcessGroupGloo`` built on that store (not the default process group:
see :class:`Group`). Each ``ProcessGroupGloo`` has its own connections and worker threads, so a bulk transfer
in flight on the leaders' group never delays an allreduce on a site's group. What runs where:

==========================================  ==================  ===================================
collective                                  channel             why
==========================================  ==================  ===================================
bsp gradient allreduce (fp32/fp16/fixed)    Horovod             the plain-Horovod baseline itself
bsp fixed-bit allreduce between sites       site, then columns  exact in the site, codes across it
                                            (torch)             once per site and shard
gssp/ssp in-group gradient average          site group (torch)  must not pay the WAN per step
gssp/ssp cross-group round (async)          leaders (torch)     must not block in-site training
in-group broadcast of a received round      site group (torch)  one WAN transfer per site, not |g|
epoch-end average (local-sgd; gssp buffers) site then leaders   WAN bytes of one copy per site
bsp-hier / fedavg / diloco site rounds      site then leaders   in-site exact, one copy per site
barriers, small values and state           world (torch)       long timeout; the watchdog decides;
                                                                a small JSON value travels with its
                                                                size, as a star through rank 0
==========================================  ==================  ===================================

The synchronisation groups, when every rank can name them at launch (one per host, from the
launcher's placement, :mod:`medseg.distributed.launch.rank_hosts`), connect on a thread while the
world group connects (:meth:`Channel.set_groups` then adopts them): each ``ProcessGroupGloo``'s
full-mesh connect is a series of store reads and TCP handshakes, so across sites it waits on round
trips, and two of them side by side take about as long as one.

Small values and state cross as declared wire messages (:mod:`medseg.distributed.comm.wire`: JSON
of a declared schema, tensors with a declared dtype and shape), never as pickles: each sender's
size is exchanged first and checked against the kind's limit before anything is allocated, and a
malformed message stops every rank with a RunError naming the sender (:meth:`Channel.describe`).

The store and the process groups use a long timeout (``dist.timeout_s`` x 20, at least an hour):
a slow data load or validation is not a failure; the launcher's watchdog, fed by heartbeats, is
what decides that a rank is gone (see :mod:`medseg.distributed.launch.heartbeat`).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from medseg.distributed.background import InBackground
from medseg.distributed.comm import audit, auth, wire
from medseg.distributed.comm.store_address import (
    listen_on,
    own_address,
    rendezvous_address,
    share_address,
    use_job_interface,
)
from medseg.errors import RunError

log = logging.getLogger(__name__)

# A JSON message of at most this many bytes travels with its size in one collective (one WAN
# round trip instead of two: sizes, then bytes); a larger one still takes the two.
INLINE_JSON_BYTES = 2048

# An allgather of at most this many bytes per member (control values, metrics, sizes) goes through
# the group's first member (:meth:`Group.allgather`); larger ones go around Gloo's ring.
STAR_MAX_BYTES = 64 * 1024


def default_names(size: int) -> list[str]:
    return [f"rank {r}" for r in range(size)]


class Group:
    """A ``ProcessGroupGloo`` over ``ranks`` (global rank numbers; this rank among them).

    Built directly on a store, not through ``torch.distributed.init_process_group``: medseg's
    channel stays private, so libraries that synchronise whenever a default process group exists
    (MONAI's metrics all-gather their buffers) keep computing per process, as rank 0's validation
    needs. ``names`` (shared with the channel) says how to name a global rank in an error.
    """

    def __init__(
        self,
        store: Any,
        name: str,
        ranks: list[int],
        rank: int,
        timeout: datetime.timedelta,
        names: list[str] | None = None,
    ) -> None:
        self.name = name  # its prefix in the channel's store
        self.ranks = sorted(ranks)
        self.index = self.ranks.index(rank)
        self.size = len(self.ranks)
        self.names = names if names is not None else default_names(max(self.ranks) + 1)
        try:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), self.index, self.size, timeout)
        except RuntimeError as exc:
            if "job-secret check" in str(exc):
                raise RunError(f"channel group {name!r}: {str(exc).splitlines()[0][:400]}") from None
            raise

    def root(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def describe(self, index: int) -> str:
        """The member at ``index`` as errors name it (``rank 2 (site b)``)."""
        r = self.ranks[index]
        return self.names[r] if r < len(self.names) else f"rank {r}"

    def allreduce_(self, tensor: torch.Tensor, async_op: bool = False, kind: str = "control") -> Any:
        """Sum ``tensor`` over the group in place; with ``async_op`` return the work handle.

        ``kind`` says what the tensor is for the audit of what leaves a site (:mod:`.audit`)."""
        audit.sent(self.ranks, "allreduce", kind, tensor)
        work = self.pg.allreduce([tensor])
        if async_op:
            return work
        work.wait()
        return None

    def broadcast_(self, tensor: torch.Tensor, src: int, kind: str = "control") -> None:
        """Copy global rank ``src``'s ``tensor`` to every member, in place."""
        if self.ranks[self.index] == src:
            audit.sent(self.ranks, "broadcast", kind, tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.root(src), 0
        self.pg.broadcast([tensor], opts).wait()

    def allgather(
        self, outs: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False, kind: str = "control"
    ) -> Any:
        """Every member's ``tensor`` into ``outs``, in member order; with ``async_op`` the work handle.

        A small blocking one (at most :data:`STAR_MAX_BYTES`, three or more members) is a star
        (:meth:`_star_allgather`); the rest use Gloo's ring allgather.
        """
        if not async_op and self.size > 2 and tensor.numel() * tensor.element_size() <= STAR_MAX_BYTES:
            self._star_allgather(outs, tensor, kind)
            return None
        audit.sent(self.ranks, "allgather", kind, tensor)
        work = self.pg.allgather([outs], [tensor])
        if async_op:
            return work
        work.wait()
        return None

    def _star_allgather(self, outs: list[torch.Tensor], tensor: torch.Tensor, kind: str) -> None:
        """An allgather as a gather to the first member and its broadcast of all the parts.

        A ring allgather of n members takes n − 1 steps in sequence, each as slow as the slowest
        link in the ring, and Gloo waits a round trip per step; between sites every step crosses
        the WAN. The star takes two: every member's part to the first member (over that member's
        links, in parallel), then the n parts back from it. On the benchmark's dilated links
        (round trips 0.6-1.3 s, four ranks at three sites) a small allgather took 3.8 s as a ring
        and 1.0-1.2 s as a star. The first member relays the other members' parts, as a ring's
        members relay their neighbours'; the result is the same on every member, in member order.
        """
        audit.sent(self.ranks, "gather", kind, tensor)
        gather = dist.GatherOptions()
        gather.rootRank = 0
        joined = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype)
        if self.index == 0:
            parts = list(joined.unbind(0))
            self.pg.gather([parts], [tensor.contiguous()], gather).wait()
            audit.sent(self.ranks, "broadcast", kind, joined)
        else:
            self.pg.gather([], [tensor.contiguous()], gather).wait()
        bcast = dist.BroadcastOptions()
        bcast.rootRank, bcast.rootTensor = 0, 0
        self.pg.broadcast([joined], bcast).wait()
        for out, part in zip(outs, joined.unbind(0)):
            out.copy_(part)

    def alltoall(
        self,
        recv: torch.Tensor,
        send: torch.Tensor,
        recv_splits: list[int],
        send_splits: list[int],
        kind: str = "gradients",
    ) -> None:
        audit.sent(self.ranks, "alltoall", kind, send)
        self.pg.alltoall_base(recv, send, recv_splits, send_splits, dist.AllToAllOptions()).wait()

    def barrier(self) -> None:
        """No member leaves before every member has entered: an allgather of one byte (a star)."""
        self.allgather(
            [torch.empty(1, dtype=torch.uint8) for _ in range(self.size)], torch.zeros(1, dtype=torch.uint8)
        )

    def barrier_with(self, value: int, src: int) -> int:
        """A barrier that also carries global rank ``src``'s integer ``value`` to every member.

        One allgather of one int64 per member (no member completes it before every member has
        entered it); ``src``'s entry is the result and every other entry is ignored, so no other
        member can change it.
        """
        outs = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.allgather(outs, torch.tensor([value], dtype=torch.int64))
        return int(outs[self.root(src)][0])

    # -- declared messages (medseg.distributed.comm.wire) ------------------------------------------
    def _sizes(self, mine: list[int], limits: list[int], what: str) -> list[list[int]]:
        """Every member's sizes (``len(mine)`` numbers each), each checked against ``limits`` first."""
        outs = [torch.zeros(len(mine), dtype=torch.int64) for _ in range(self.size)]
        self.allgather(outs, torch.tensor(mine, dtype=torch.int64))
        sizes = [[int(x) for x in o] for o in outs]
        for j, row in enumerate(sizes):
            for n, limit in zip(row, limits):
                self._check_announced(j, n, limit, what)
        return sizes

    def _check_announced(self, j: int, n: int, limit: int, what: str) -> None:
        if not 0 <= n <= limit:
            raise wire.refuse(self.describe(j), what, f"it announced {n} bytes, the limit is {limit}")

    def _allgather_bytes(self, data: torch.Tensor, sizes: list[int], kind: str) -> list[torch.Tensor]:
        """Every member's uint8 ``data`` (``sizes[j]`` bytes from member j; padded to the largest)."""
        top = max(sizes)
        if top == 0:
            return [torch.zeros(0, dtype=torch.uint8) for _ in sizes]
        padded = torch.zeros(top, dtype=torch.uint8)
        padded[: data.numel()] = data
        outs = [torch.empty(top, dtype=torch.uint8) for _ in range(self.size)]
        self.allgather(outs, padded, kind=kind)
        return [o[:n] for o, n in zip(outs, sizes)]

    def gather_json(self, value: Any, schema: str, kind: str = "control") -> list[Any]:
        """Every member's ``value`` on every member, in rank order, as a JSON message of ``schema``
        (:data:`medseg.distributed.comm.wire.SCHEMAS`); a malformed one stops every member."""
        raw = wire.encode_json(value)
        outs = [torch.empty(8 + INLINE_JSON_BYTES, dtype=torch.uint8) for _ in range(self.size)]
        self.allgather(outs, inline_slot(raw), kind=kind)
        sizes = [slot_size(o) for o in outs]
        for j, n in enumerate(sizes):
            self._check_announced(j, n, wire.MAX_JSON_BYTES, schema)
        if max(sizes) <= INLINE_JSON_BYTES:
            got = [o[8 : 8 + n] for o, n in zip(outs, sizes)]
        else:  # every member saw the same sizes, so every member takes this second trip
            got = self._allgather_bytes(torch.frombuffer(bytearray(raw), dtype=torch.uint8), sizes, kind)
        return [wire.decode_json(g.numpy().tobytes(), schema, self.describe(j)) for j, g in enumerate(got)]

    def gather_tree(self, obj: Any, tree: str, kind: str = "control") -> list[Any]:
        """Every member's ``obj`` (tensors and JSON values) on every member, as tree messages of ``tree``."""
        spec = wire.TREES[tree]
        header, payload = wire.pack_tree(obj)
        hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        sizes = self._sizes([hdr.numel(), payload.numel()], [spec.max_header, spec.max_payload], tree)
        headers = self._allgather_bytes(hdr, [s[0] for s in sizes], kind)
        parsed = [self._header(h, s[1], tree, j) for j, (h, s) in enumerate(zip(headers, sizes))]
        payloads = self._allgather_bytes(payload, [s[1] for s in sizes], kind)
        return [self._unpack(p, body, tree, j) for j, (p, body) in enumerate(zip(parsed, payloads))]

    def _header(self, header: torch.Tensor, payload_size: int, tree: str, j: int) -> tuple[Any, list]:
        try:
            node, manifest, total = wire.tree_header(header.numpy().tobytes(), wire.TREES[tree])
        except wire.Malformed as exc:
            raise wire.refuse(self.describe(j), tree, str(exc)) from None
        if total != payload_size:
            raise wire.refuse(
                self.describe(j), tree, f"its tensors declare {total} bytes, it announced {payload_size}"
            )
        return node, manifest

    def _unpack(self, parsed: tuple[Any, list], payload: torch.Tensor, tree: str, j: int) -> Any:
        try:
            return wire.unpack_tree(parsed[0], parsed[1], payload, wire.TREES[tree])
        except wire.Malformed as exc:
            raise wire.refuse(self.describe(j), tree, str(exc)) from None

    def broadcast_tree(self, obj: Any, src: int, tree: str, kind: str = "control") -> Any:
        """Global rank ``src``'s ``obj`` on every member, as a tree message of ``tree`` (``src`` decodes
        its own message too, so every member holds the same rebuilt object)."""
        spec = wire.TREES[tree]
        sender = self.describe(self.root(src))
        me = self.ranks[self.index] == src
        header, payload = wire.pack_tree(obj) if me else (b"", torch.zeros(0, dtype=torch.uint8))
        sizes = torch.tensor([len(header), payload.numel()], dtype=torch.int64)
        self.broadcast_(sizes, src)
        n_header, n_payload = int(sizes[0]), int(sizes[1])
        if not 0 <= n_header <= spec.max_header or not 0 <= n_payload <= spec.max_payload:
            raise wire.refuse(
                sender, tree, f"it announced {n_header} + {n_payload} bytes, over the kind's limits"
            )
        hdr = (
            torch.frombuffer(bytearray(header), dtype=torch.uint8)
            if me
            else torch.empty(n_header, dtype=torch.uint8)
        )
        if n_header:
            self.broadcast_(hdr, src, kind=kind)
        parsed = self._header(hdr, n_payload, tree, self.root(src))
        body = payload if me else torch.empty(n_payload, dtype=torch.uint8)
        if n_payload:
            self.broadcast_(body, src, kind=kind)
        return self._unpack(parsed, body, tree, self.root(src))

    def broadcast_json(self, value: Any, src: int, schema: str, kind: str = "control") -> Any:
        """Global rank ``src``'s ``value`` on every member, as a JSON message of ``schema``."""
        me = self.ranks[self.index] == src
        data = wire.encode_json(value) if me else b""
        slot = inline_slot(data) if me else torch.empty(8 + INLINE_JSON_BYTES, dtype=torch.uint8)
        self.broadcast_(slot, src, kind=kind)
        size = slot_size(slot)
        self._check_announced(self.root(src), size, wire.MAX_JSON_BYTES, schema)
        if size <= INLINE_JSON_BYTES:
            buf = slot[8 : 8 + size]
        else:
            buf = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if me
                else torch.empty(size, dtype=torch.uint8)
            )
            self.broadcast_(buf, src, kind=kind)
        return wire.decode_json(buf.numpy().tobytes(), schema, self.describe(self.root(src)))


def inline_slot(data: bytes) -> torch.Tensor:
    """``data``'s size (int64, the machine's byte order) and, when it fits, the bytes themselves,
    in a slot of ``8 + INLINE_JSON_BYTES`` bytes (zeros after them)."""
    slot = torch.zeros(8 + INLINE_JSON_BYTES, dtype=torch.uint8)
    slot[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if 0 < len(data) <= INLINE_JSON_BYTES:
        slot[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return slot


def slot_size(slot: torch.Tensor) -> int:
    """The size an :func:`inline_slot` announces (unchecked: the caller checks it against its limit)."""
    return int(slot[:8].clone().view(torch.int64)[0])


def gather_tree_to_root(
    group: Group, obj: Any, tree: str, root: int = 0, kind: str = "optimizer-state"
) -> tuple[list[Any] | None, list[int]]:
    """``obj`` of every member, on global rank ``root`` only (None elsewhere), as tree messages of
    ``tree``, and each one's payload size.

    Unlike :meth:`Group.gather_tree` nothing travels to the other members: for checkpoint state
    that only rank 0 writes, the WAN carries each remote rank's state once.
    """
    spec = wire.TREES[tree]
    header, payload = wire.pack_tree(obj)
    hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    sizes = group._sizes([hdr.numel(), payload.numel()], [spec.max_header, spec.max_payload], tree)
    opts = dist.GatherOptions()
    opts.rootRank = group.root(root)
    me = group.ranks[group.index] == root
    results: list[list[torch.Tensor]] = []
    for col, mine in ((0, hdr), (1, payload)):
        top = max(s[col] for s in sizes)
        if top == 0:
            results.append([torch.zeros(0, dtype=torch.uint8) for _ in sizes])
            continue
        padded = torch.zeros(top, dtype=torch.uint8)
        padded[: mine.numel()] = mine
        if me:
            outs = [torch.empty(top, dtype=torch.uint8) for _ in range(group.size)]
            group.pg.gather([outs], [padded], opts).wait()
            results.append([o[: s[col]] for o, s in zip(outs, sizes)])
        else:
            audit.sent([root], "gather", kind, padded)
            group.pg.gather([], [padded], opts).wait()
    payload_sizes = [s[1] for s in sizes]
    if not me:
        return None, payload_sizes
    objs = []
    for j, (h, body) in enumerate(zip(results[0], results[1])):
        parsed = group._header(h, sizes[j][1], tree, j)
        objs.append(group._unpack(parsed, body, tree, j))
    return objs, payload_sizes


class Channel:
    """The job's private Gloo world plus one group per sync group and one of their leaders.

    Args:
        hvd: ``horovod.torch``, initialised.
        timeout_s: the job's ``dist.timeout_s``; the groups wait up to 20x that (>= 1 h).
        secret: the job secret (default: ``MEDSEG_JOB_SECRET``, required).
    """

    def __init__(self, hvd: Any, timeout_s: float, secret: bytes | None = None) -> None:
        secret = secret if secret is not None else auth.job_secret()
        assert secret is not None
        use_job_interface()
        self._open(hvd.rank(), hvd.size(), timeout_s, secret, lambda where: share_address(hvd, secret, where))

    @classmethod
    def before_horovod(
        cls,
        server: tuple[str, int],
        timeout_s: float,
        secret: bytes,
        early_groups: list[list[int]] | None = None,
    ) -> Channel:
        """The channel of the rank ``horovodrun`` started (``HOROVOD_RANK``/``HOROVOD_SIZE``), its store
        address shared through the rendezvous ``server``: needs no Horovod call, so it can be built on a
        thread while ``hvd.init()`` runs. Call :func:`use_job_interface` first, on the main thread.
        ``early_groups``: the synchronisation groups, connected beside the world group."""
        rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
        channel = cls.__new__(cls)
        wait_s = max(3600.0, 20 * timeout_s)
        channel._open(
            rank,
            size,
            timeout_s,
            secret,
            lambda where: rendezvous_address(server, secret, where, wait_s, size),
            early_groups,
        )
        return channel

    def _open(
        self,
        rank: int,
        size: int,
        timeout_s: float,
        secret: bytes,
        share: Callable[[tuple[str, int] | None], tuple[str, int]],
        early_groups: list[list[int]] | None = None,
    ) -> None:
        """Host (rank 0) or join the store whose address ``share`` hands every rank, then the world
        group (and, on a thread beside it, ``early_groups``' connections)."""
        self.rank, self.size = rank, size
        self.timeout = datetime.timedelta(seconds=max(3600.0, 20 * timeout_s))
        listener = None
        where = None
        if self.rank == 0:
            host = own_address()
            listener = listen_on(host)  # the store listens on the job's address only
            where = (host, int(listener.getsockname()[1]))
        tic = time.perf_counter()
        host, port = share(where)
        shared = time.perf_counter()
        if listener is not None:
            tcp = dist.TCPStore(
                host,
                port,
                self.size,
                is_master=True,
                timeout=self.timeout,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
        else:
            tcp = dist.TCPStore(
                host, port, self.size, is_master=False, timeout=self.timeout, wait_for_workers=False
            )
        self.store = auth.MacStore(tcp, secret)
        self.names = default_names(self.size)
        stored = time.perf_counter()
        early = [sorted(g) for g in early_groups] if early_groups else None
        self._early = (
            (early, InBackground(self._connect_early, early, (host, port), secret)) if early else None
        )
        self.world = Group(self.store, "world/", list(range(self.size)), self.rank, self.timeout, self.names)
        # seconds of each step of the channel's start-up (reported with the session's own)
        self.startup = {
            "channel_address": round(shared - tic, 3),
            "channel_store": round(stored - shared, 3),
            "channel_world": round(time.perf_counter() - stored, 3),
        }
        log.debug("rank %d: medseg Gloo channel via %s:%d", self.rank, host, port)
        self.groups: list[list[int]] = [list(range(self.size))]
        self.group: list[int] = list(range(self.size))
        self.group_pg: Group | None = None
        self.leaders_pg: Group | None = None
        self.leader = 0

    def name_ranks(self, rank_sites: list[str] | None) -> None:
        """Name every rank by where it runs in errors from now on: ``rank_sites[r]`` is ``site b`` or
        ``host gpu2``, so rank 2 is ``rank 2 (site b)``."""
        for r in range(self.size):
            self.names[r] = f"rank {r} ({rank_sites[r]})" if rank_sites else f"rank {r}"

    def describe(self, rank: int) -> str:
        return self.names[rank]

    def set_groups(self, groups: list[list[int]]) -> None:
        """Build this rank's sync group and, on leaders, the leaders' group (members only connect);
        the groups connected at start-up when they are these."""
        self.groups = [sorted(g) for g in groups]
        i = next(i for i, g in enumerate(self.groups) if self.rank in g)
        self.group = self.groups[i]
        self.leader = self.group[0]
        early, self._early = self._early, None
        if early is not None and early[0] == self.groups:
            self.group_pg, self.leaders_pg = early[1].result()
        else:
            self.group_pg, self.leaders_pg = self._connect(self.groups, "")

    def _connect_early(
        self, groups: list[list[int]], where: tuple[str, int], secret: bytes
    ) -> tuple[Group | None, Group | None]:
        """:meth:`_connect` for the groups named at launch, through a store connection of their own:
        a store client waits for a key while holding its connection, so the world group's
        rendezvous on the channel's connection would wait behind theirs (and the ranks deadlock)."""
        tcp = dist.TCPStore(
            where[0], where[1], self.size, is_master=False, timeout=self.timeout, wait_for_workers=False
        )
        return self._connect(groups, "early-", auth.MacStore(tcp, secret))

    def _connect(
        self, groups: list[list[int]], prefix: str, store: Any = None
    ) -> tuple[Group | None, Group | None]:
        """This rank's group of ``groups`` (None alone) and, on a leader, the leaders' group; every
        member of a group calls this with the same ``groups`` and ``prefix`` (``store``: the
        channel's unless given)."""
        store = store if store is not None else self.store
        group = next(g for g in groups if self.rank in g)
        key = "-".join(map(str, group))
        group_pg = (
            Group(store, f"{prefix}group{key}/", group, self.rank, self.timeout, self.names)
            if len(group) > 1
            else None
        )
        leaders = [g[0] for g in groups]
        leaders_pg = (
            Group(store, f"{prefix}leaders/", leaders, self.rank, self.timeout, self.names)
            if self.rank == group[0]
            else None
        )
        return group_pg, leaders_pg

    def make_group(self, tag: str, ranks: list[int]) -> Group:
        """A new group over ``ranks`` (this rank among them) on the channel's store; ``tag`` must be
        unique in the job, and every member must make its groups in the same order."""
        if self.rank not in ranks:
            raise ValueError(f"channel: rank {self.rank} cannot make group {tag!r} of ranks {ranks}")
        return Group(self.store, tag, list(ranks), self.rank, self.timeout, self.names)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def barrier(self) -> None:
        self.world.barrier()

    def barrier_with(self, value: int, src: int = 0) -> int:
        """A barrier of every rank that also carries rank ``src``'s integer (:meth:`Group.barrier_with`)."""
        return self.world.barrier_with(value, src)

    def gather_json(self, value: Any, schema: str, kind: str = "control") -> list[Any]:
        """Every rank's ``value`` on every rank, in rank order (a JSON message of ``schema``)."""
        return self.world.gather_json(value, schema, kind=kind)

    def broadcast_json(self, value: Any, schema: str, src: int = 0, kind: str = "control") -> Any:
        """Rank ``src``'s ``value`` on every rank (a JSON message of ``schema``)."""
        return self.world.broadcast_json(value, src, schema, kind=kind)

    def gather_tree(self, obj: Any, tree: str, kind: str = "control") -> list[Any]:
        """Every rank's ``obj`` (tensors and JSON values) on every rank (tree messages of ``tree``)."""
        return self.world.gather_tree(obj, tree, kind=kind)

    def broadcast_tree(self, obj: Any, tree: str, src: int = 0, kind: str = "control") -> Any:
        """Rank ``src``'s ``obj`` (tensors and JSON values) on every rank (a tree message of ``tree``)."""
        return self.world.broadcast_tree(obj, src, tree, kind=kind)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0, kind: str = "parameters") -> None:
        self.world.broadcast_(tensor, src, kind=kind)

    def group_broadcast(self, tensor: torch.Tensor) -> None:
        """Copy the group leader's ``tensor`` to every member of this rank's group (in place)."""
        if self.group_pg is not None:
            self.group_pg.broadcast_(tensor, self.leader)

    def group_mean_(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` over this rank's group (in place)."""
        if self.group_pg is not None:
            self.group_pg.allreduce_(tensor)
            tensor /= len(self.group)

    def close(self) -> None:
        """Drop the groups (their connections close with them)."""
        self.group_pg = self.leaders_pg = None
