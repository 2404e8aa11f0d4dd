"""medseg's own collectives beside Horovod: a ``torch.distributed`` Gloo channel per job.

Why a second channel. Horovod runs every CPU (Gloo) collective of a process, whatever its process
set, one after another in one background thread, and each of that thread's cycles first
coordinates every process set, the global one included. So an in-group allreduce waits while a
global ``allreduce_async_`` is pending, and across hospitals every in-site Horovod allreduce pays
the WAN round trip, which a ``torch.distributed`` group of the site does not (the measurements are
in docs/design.md, "Where each collective runs"). An "asynchronous" cross-site exchange on Horovod
therefore stalls the sites, and Horovod process sets do not isolate sites.

So every rank of a launched job also joins a private Gloo job of its own, made from Horovod's rank
and size (rank 0 hosts a ``torch.distributed`` TCP store on its own address and announces it with
one Horovod broadcast): a world group, its synchronisation group and, on leaders, the group of the
groups' leaders, each a ``ProcessGroupGloo`` built on that store (not the default process group:
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
epoch-end model average (gssp, local-sgd)   site then leaders   WAN bytes of one copy per site
barriers, object exchange                   world (torch)       long timeout; the watchdog decides
==========================================  ==================  ===================================

The store and the process groups use a long timeout (``dist.timeout_s`` x 20, at least an hour):
a slow data load or validation is not a failure; the launcher's watchdog, fed by heartbeats, is
what decides that a rank is gone (see :mod:`medseg.distributed.launch.heartbeat`).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
from typing import Any

import torch
import torch.distributed as dist

from medseg.distributed.comm import audit

log = logging.getLogger(__name__)


def _own_address() -> str:
    """The address other ranks reach this one on: the Gloo interface's, else the hostname's."""
    iface = os.environ.get("HOROVOD_GLOO_IFACE") or os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        try:
            import psutil

            for addr in psutil.net_if_addrs().get(iface, []):
                if addr.family == socket.AF_INET:
                    return addr.address
        except ImportError:  # pragma: no cover - psutil comes with Horovod
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Group:
    """A ``ProcessGroupGloo`` over ``ranks`` (global rank numbers; this rank among them).

    Built directly on a store, not through ``torch.distributed.init_process_group``: medseg's
    channel stays private, so libraries that synchronise whenever a default process group exists
    (MONAI's metrics all-gather their buffers) keep computing per process, as rank 0's validation
    needs.
    """

    def __init__(
        self, store: Any, name: str, ranks: list[int], rank: int, timeout: datetime.timedelta
    ) -> None:
        self.ranks = sorted(ranks)
        self.index = self.ranks.index(rank)
        self.size = len(self.ranks)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), self.index, self.size, timeout)

    def root(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

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
        audit.sent(self.ranks, "allgather", kind, tensor)
        work = self.pg.allgather([outs], [tensor])
        if async_op:
            return work
        work.wait()
        return None

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
        # Gloo's barrier is an allreduce of nothing; an allreduce of one value is just as good.
        self.allreduce_(torch.zeros(1))

    def gather_objects(self, obj: Any, kind: str = "control") -> list[Any]:
        """Every member's ``obj`` on every member, in rank order (pickled; our own ranks only)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.allgather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
        top = max(int(s) for s in sizes)
        padded = torch.zeros(top, dtype=torch.uint8)
        padded[: data.numel()] = data
        outs = [torch.empty(top, dtype=torch.uint8) for _ in range(self.size)]
        self.allgather(outs, padded, kind=kind)
        return [pickle.loads(o[: int(s)].numpy().tobytes()) for o, s in zip(outs, sizes)]


def gather_to_root(
    group: Group, obj: Any, root: int = 0, kind: str = "optimizer-state"
) -> tuple[list[Any] | None, list[int]]:
    """``obj`` of every member, on global rank ``root`` only (None elsewhere), and each one's pickled size.

    Unlike :meth:`Group.gather_objects` nothing travels to the other members: for checkpoint state
    that only rank 0 writes, the WAN carries each remote rank's state once.
    """
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes_t = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size)]
    group.allgather(sizes_t, torch.tensor([data.numel()], dtype=torch.int64))
    sizes = [int(s) for s in sizes_t]
    top = max(sizes)
    padded = torch.zeros(top, dtype=torch.uint8)
    padded[: data.numel()] = data
    opts = dist.GatherOptions()
    opts.rootRank = group.root(root)
    if group.ranks[group.index] == root:
        outs = [torch.empty(top, dtype=torch.uint8) for _ in range(group.size)]
        group.pg.gather([outs], [padded], opts).wait()
        return [pickle.loads(o[:n].numpy().tobytes()) for o, n in zip(outs, sizes)], sizes
    audit.sent([root], "gather", kind, padded)
    group.pg.gather([], [padded], opts).wait()
    return None, sizes


class Channel:
    """The job's private Gloo world plus one group per sync group and one of their leaders.

    Args:
        hvd: ``horovod.torch``, initialised.
        timeout_s: the job's ``dist.timeout_s``; the groups wait up to 20x that (>= 1 h).
    """

    def __init__(self, hvd: Any, timeout_s: float) -> None:
        self.rank, self.size = hvd.rank(), hvd.size()
        if "GLOO_SOCKET_IFNAME" not in os.environ and os.environ.get("HOROVOD_GLOO_IFACE"):
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["HOROVOD_GLOO_IFACE"]
        self.timeout = datetime.timedelta(seconds=max(3600.0, 20 * timeout_s))
        where = None
        if self.rank == 0:
            host = _own_address()
            where = [host, _free_port(host)]
        host, port = hvd.broadcast_object(where, root_rank=0, name="medseg.channel")
        self.store = dist.TCPStore(
            host, int(port), self.size, is_master=self.rank == 0, timeout=self.timeout, wait_for_workers=False
        )
        self.world = Group(self.store, "world/", list(range(self.size)), self.rank, self.timeout)
        log.debug("rank %d: medseg Gloo channel via %s:%d", self.rank, host, port)
        self.groups: list[list[int]] = [list(range(self.size))]
        self.group: list[int] = list(range(self.size))
        self.group_pg: Group | None = None
        self.leaders_pg: Group | None = None
        self.leader = 0

    def set_groups(self, groups: list[list[int]]) -> None:
        """Build this rank's sync group and, on leaders, the leaders' group (members only connect)."""
        self.groups = [sorted(g) for g in groups]
        i = next(i for i, g in enumerate(self.groups) if self.rank in g)
        self.group = self.groups[i]
        self.leader = self.group[0]
        key = "-".join(map(str, self.group))
        self.group_pg = (
            Group(self.store, f"group{key}/", self.group, self.rank, self.timeout)
            if len(self.group) > 1
            else None
        )
        leaders = [g[0] for g in self.groups]
        self.leaders_pg = (
            Group(self.store, "leaders/", leaders, self.rank, self.timeout) if self.is_leader else None
        )

    def make_group(self, tag: str, ranks: list[int]) -> Group:
        """A new group over ``ranks`` (this rank among them) on the channel's store; ``tag`` must be
        unique in the job, and every member must make its groups in the same order."""
        if self.rank not in ranks:
            raise ValueError(f"channel: rank {self.rank} cannot make group {tag!r} of ranks {ranks}")
        return Group(self.store, tag, list(ranks), self.rank, self.timeout)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def barrier(self) -> None:
        self.world.barrier()

    def gather_objects(self, obj: Any, kind: str = "control") -> list[Any]:
        """Every rank's ``obj`` on every rank, in rank order."""
        return self.world.gather_objects(obj, kind=kind)

    def broadcast_object(self, obj: Any, src: int = 0, kind: str = "control") -> Any:
        """``obj`` of rank ``src`` on every rank (its size first, then its pickled bytes)."""
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.world.broadcast_(size, src)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(int(size), dtype=torch.uint8)
        )
        self.world.broadcast_(buf, src, kind=kind)
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

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


class TorchTransport:
    """The three collectives :class:`~medseg.distributed.comm.collectives.CompressedAllreduce` needs, on a
    channel :class:`Group`. Its allgather pads every block to the largest (Gloo's allgather takes
    equal blocks), so a member sends ``(n - 1) * max(block)`` bytes in the ring."""

    pads_allgather = True

    def __init__(self, group: Group) -> None:
        self.group = group

    def size(self) -> int:
        return self.group.size

    def index(self) -> int:
        return self.group.index

    def allreduce_mean(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        out = flat.clone()
        self.group.allreduce_(out, kind="gradients")
        return out / self.group.size

    def alltoall(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], name: str):
        recv = torch.empty(sum(recv_splits), dtype=send.dtype)
        self.group.alltoall(recv, send, recv_splits, send_splits)
        return recv

    def allgather(self, mine: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
        """Concatenate every member's block (``sizes[j]`` bytes from member ``j``): padded to the largest."""
        top = max(sizes)
        padded = torch.zeros(top, dtype=mine.dtype)
        padded[: mine.numel()] = mine
        outs = [torch.empty(top, dtype=mine.dtype) for _ in sizes]
        self.group.allgather(outs, padded, kind="gradients")
        return torch.cat([o[:s] for o, s in zip(outs, sizes)])


class HorovodTransport:
    """The same three collectives on a Horovod process set (bsp's compressed allreduce)."""

    def __init__(self, hvd: Any, process_set: Any) -> None:
        self.hvd, self.ps = hvd, process_set

    def size(self) -> int:
        return int(self.ps.size())

    def index(self) -> int:
        return int(self.ps.rank())

    def allreduce_mean(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allreduce(flat, op=self.hvd.Average, name=name, process_set=self.ps)

    def alltoall(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], name: str):
        splits = torch.tensor(send_splits, dtype=torch.int32)
        recv, got = self.hvd.alltoall(send, splits=splits, name=name, process_set=self.ps)
        return recv

    def allgather(self, mine: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
        return self.hvd.allgather(mine, name=name, process_set=self.ps)
