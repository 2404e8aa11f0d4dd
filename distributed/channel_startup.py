"""A rank's first steps on medseg's channel: the channel itself and every rank's host name.

Under ``horovodrun --gloo`` both need no Horovod call (the store address travels through the
launcher's rendezvous server, :meth:`~medseg.distributed.comm.channel.Channel.before_horovod`), so
:func:`start_beside_horovod` runs them on a thread while ``hvd.init()`` does its own rendezvous.
Both wait on round trips, not on compute, so across slow links the job's start-up costs about the
longer of the two instead of their sum (measured in docs/benchmarks.md, "Between hospitals on real
MR": ``channel wait`` is what remained of the channel's phases after ``hvd.init()``). Launched
otherwise (an MPI ``horovodrun``), :func:`start_after_horovod` builds the channel after
``hvd.init()`` and shares its address with one Horovod broadcast.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from medseg.distributed.background import InBackground
from medseg.distributed.comm import rendezvous_kv
from medseg.distributed.comm.channel import Channel
from medseg.distributed.comm.store_address import use_job_interface
from medseg.errors import RunError

Started = tuple[Channel, list[str], dict[str, float]]  # channel, every rank's host, start-up phases (s)


def own_host() -> str:
    """The host name this rank was started on, as the launcher named it."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def _with_hosts(channel: Channel) -> Started:
    """``channel``, every rank's host (one small all-gather) and the seconds each step took."""
    tic = time.perf_counter()
    hosts = channel.gather_json(own_host(), "hostname")
    return channel, hosts, {**channel.startup, "hostnames": round(time.perf_counter() - tic, 3)}


def _open_and_gather(server: tuple[str, int], timeout_s: float, secret: bytes) -> Started:
    return _with_hosts(Channel.before_horovod(server, timeout_s, secret))


def start_beside_horovod(timeout_s: float, secret: bytes) -> InBackground | None:
    """Start building the channel and gathering host names on a thread, before ``hvd.init()``;
    ``None`` where this rank was not started by ``horovodrun --gloo`` (no rendezvous server)."""
    server = rendezvous_kv.server_from_env()
    if server is None or "HOROVOD_RANK" not in os.environ or "HOROVOD_SIZE" not in os.environ:
        return None
    use_job_interface()  # on this thread: Horovod's own threads read the environment
    return InBackground(_open_and_gather, server, timeout_s, secret)


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


def joined(started: InBackground, rank: int, size: int) -> Started:
    """What :func:`start_beside_horovod` built, once ``hvd.init()`` has told this rank its place;
    a rank whose environment disagrees with Horovod is refused. (The check comes after the channel is
    built: under horovodrun, which sets both, a disagreement would be Horovod's own bug.)"""
    channel, hosts, phases = started.result()
    if (channel.rank, channel.size) != (rank, size):
        raise RunError(
            f"HOROVOD_RANK/HOROVOD_SIZE say rank {channel.rank} of {channel.size}, Horovod says {rank} of {size}"
        )
    return channel, hosts, phases


def start_after_horovod(hvd: Any, timeout_s: float, secret: bytes) -> Started:
    """The channel and host names after ``hvd.init()`` (address by one Horovod broadcast)."""
    return _with_hosts(Channel(hvd, timeout_s, secret))
