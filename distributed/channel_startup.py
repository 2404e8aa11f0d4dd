"""A rank's first steps on medseg's channel: the channel itself and every rank's host name.

Under ``horovodrun --gloo`` both need no Horovod call (the store address travels through the
launcher's rendezvous server, :meth:`~medseg.distributed.comm.channel.Channel.before_horovod`), so
:func:`start_beside_horovod` runs them on a thread while ``hvd.init()`` does its own rendezvous.
Both wait on round trips, not on compute, so across slow links the job's start-up costs about the
longer of the two instead of their sum (measured in docs/benchmarks.md, "Between hospitals on real
MR": ``channel wait`` is what remained of the channel's phases after ``hvd.init()``). A rank whose
sync uses only medseg's channel (every sync but bsp and bsp-hier) does not wait for ``hvd.init()``
at all: :func:`start_rank` leaves it running beside the rest of the start-up and training, and the
session waits for it only before ``hvd.shutdown()`` (:class:`HorovodInit`). Launched
otherwise (an MPI ``horovodrun``), :func:`start_after_horovod` builds the channel after
``hvd.init()`` and shares its address with one Horovod broadcast.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from medseg.distributed.background import InBackground
from medseg.distributed.comm import rendezvous_kv
from medseg.distributed.comm.channel import Channel
from medseg.distributed.comm.store_address import use_job_interface
from medseg.distributed.launch import rank_hosts
from medseg.errors import RunError

Started = tuple[Channel, list[str], dict[str, float]]  # channel, every rank's host, start-up phases (s)
EarlyGroups = Callable[[list[str]], "list[list[int]] | None"]  # every rank's host -> sync groups
# syncs that call Horovod during training (plain bsp's collectives; bsp-hier asks it for rank and
# size): their ranks wait for ``hvd.init()`` before training, the others only at the job's end. A
# sync added later that calls Horovod belongs here (the session also waits before BulkSynchronous).
HOROVOD_SYNCS = ("bsp", "bsp-hier")


def own_host() -> str:
    """The host name this rank was started on, as the launcher named it."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def _with_hosts(channel: Channel) -> Started:
    """``channel``, every rank's host and the seconds each step took: the hosts as medseg's launcher
    placed the ranks (:mod:`~medseg.distributed.launch.rank_hosts`), else one small all-gather."""
    tic = time.perf_counter()
    hosts = rank_hosts.from_env(channel.rank, channel.size, own_host())
    if hosts is None:
        hosts = channel.gather_json(own_host(), "hostname")
    return channel, hosts, {**channel.startup, "hostnames": round(time.perf_counter() - tic, 3)}


def no_early_groups(hosts: list[str]) -> None:
    """No sync groups named at launch: they connect when the session sets them."""
    return None


def _open_and_gather(
    server: tuple[str, int], timeout_s: float, secret: bytes, early_groups: EarlyGroups
) -> Started:
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    hosts = rank_hosts.from_env(rank, size, own_host())
    early = early_groups(hosts) if hosts is not None else None
    return _with_hosts(Channel.before_horovod(server, timeout_s, secret, early))


def start_beside_horovod(
    timeout_s: float, secret: bytes, early_groups: EarlyGroups = no_early_groups
) -> InBackground | None:
    """Start building the channel and gathering host names on a thread, before ``hvd.init()``;
    ``None`` where this rank was not started by ``horovodrun --gloo`` (no rendezvous server).
    ``early_groups`` names the sync groups from every rank's host where it can (the launcher's
    placement): they connect beside the world group."""
    server = rendezvous_kv.server_from_env()
    if server is None or "HOROVOD_RANK" not in os.environ or "HOROVOD_SIZE" not in os.environ:
        return None
    use_job_interface()  # on this thread: Horovod's own threads read the environment
    return InBackground(_open_and_gather, server, timeout_s, secret, early_groups)


def init_horovod(hvd: Any, opening: InBackground | None) -> None:
    """``hvd.init()``; where it fails after the channel's thread already failed (say, an address
    signed with another job's secret), the thread's clearer error is raised, Horovod's as its cause."""
    try:
        hvd.init()
    except Exception as exc:
        first = opening.failed() if opening is not None else None
        if first is not None:
            raise first from exc
        raise


def _init_timed(hvd: Any, opening: InBackground, startup: dict[str, float]) -> None:
    tic = time.perf_counter()
    init_horovod(hvd, opening)
    startup["horovod_init"] = round(time.perf_counter() - tic, 3)


def init_beside(hvd: Any, opening: InBackground, startup: dict[str, float]) -> InBackground:
    """``hvd.init()`` on a thread of its own, for a rank whose sync runs on medseg's channel alone
    until the job ends: its rendezvous (tens of seconds across slow links) then overlaps the rest
    of the start-up and the first epochs instead of coming before them. Its seconds are recorded
    as ``startup["horovod_init"]`` when it ends; ``result()`` waits for it (and raises its error)."""
    return InBackground(_init_timed, hvd, opening, startup)


def opened(started: InBackground) -> Started:
    """What :func:`start_beside_horovod` built, without Horovod's word on this rank's place
    (:class:`HorovodInit` compares them once ``hvd.init()`` has ended)."""
    return started.result()


def check_place(channel_rank: int, channel_size: int, rank: int, size: int) -> None:
    """A rank whose environment (HOROVOD_RANK/HOROVOD_SIZE, the channel's) disagrees with Horovod is
    refused. (Under horovodrun, which sets both, a disagreement would be Horovod's own bug.)"""
    if (channel_rank, channel_size) != (rank, size):
        raise RunError(
            f"HOROVOD_RANK/HOROVOD_SIZE say rank {channel_rank} of {channel_size}, Horovod says {rank} of {size}"
        )


def joined(started: InBackground, rank: int, size: int) -> Started:
    """What :func:`start_beside_horovod` built, once ``hvd.init()`` has told this rank its place;
    a rank whose environment disagrees with Horovod is refused. (The check comes after the channel is
    built: under horovodrun, which sets both, a disagreement would be Horovod's own bug.)"""
    channel, hosts, phases = started.result()
    check_place(channel.rank, channel.size, rank, size)
    return channel, hosts, phases


class HorovodInit:
    """``hvd.init()`` as a rank's start-up left it: ended, or still running beside training
    (``pending``, from :func:`init_beside`); ``rank`` and ``size`` are the channel's."""

    def __init__(self, hvd: Any, pending: InBackground | None, rank: int, size: int) -> None:
        self.hvd, self.pending, self.rank, self.size = hvd, pending, rank, size

    def ended(self, timeout_s: float | None) -> bool:
        """Wait (at most ``timeout_s``; None: no bound) for the init, raise its error, check that
        Horovod agrees on this rank's place; False if it has not ended in time."""
        if self.pending is not None:
            if not self.pending.wait(timeout_s):
                return False
            pending, self.pending = self.pending, None
            pending.result()
            check_place(self.rank, self.size, self.hvd.rank(), self.hvd.size())
        return True


def start_rank(
    hvd: Any,
    sync: str,
    timeout_s: float,
    secret: bytes,
    startup: dict[str, float],
    early_groups: EarlyGroups = no_early_groups,
) -> tuple[Started, HorovodInit]:
    """A rank's channel, hosts and start-up phases, and ``hvd.init()`` where it still runs.

    Under ``horovodrun --gloo`` the channel is built beside ``hvd.init()``; a rank whose ``sync``
    needs no Horovod until the end (not :data:`HOROVOD_SYNCS`) goes on once the channel is up and
    gets the init back to wait for (:func:`init_beside`), else it waits for both here. Otherwise
    the channel is built after ``hvd.init()``. ``startup`` receives ``horovod_init`` and
    ``channel_wait`` (what remained of the channel's phases after the init). ``early_groups``: see
    :func:`start_beside_horovod`."""
    # pytorch-ignite sets HOROVOD_DYNAMIC_PROCESS_SETS=1 when imported (MONAI imports it, e.g. in a
    # benchmark that launches the ranks, whose environment they inherit); with it Horovod adds a
    # collective over every rank, across the WAN, to each cycle. medseg adds no process set later.
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "0"
    opening = start_beside_horovod(timeout_s, secret, early_groups)
    if opening is not None and sync not in HOROVOD_SYNCS:
        pending = init_beside(hvd, opening, startup)
        channel, hosts, phases = opened(opening)
        return (channel, hosts, phases), HorovodInit(hvd, pending, channel.rank, channel.size)
    tic = time.perf_counter()
    init_horovod(hvd, opening)
    startup["horovod_init"] = round(time.perf_counter() - tic, 3)
    if opening is None:
        started = start_after_horovod(hvd, timeout_s, secret)
    else:
        started = joined(opening, hvd.rank(), hvd.size())
        startup["channel_wait"] = round(time.perf_counter() - tic - startup["horovod_init"], 3)
    return started, HorovodInit(hvd, None, hvd.rank(), hvd.size())


def start_after_horovod(hvd: Any, timeout_s: float, secret: bytes) -> Started:
    """The channel and host names after ``hvd.init()`` (address by one Horovod broadcast)."""
    return _with_hosts(Channel(hvd, timeout_s, secret))
