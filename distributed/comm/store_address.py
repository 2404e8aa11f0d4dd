"""How every rank of a job learns where rank 0's channel store listens (:mod:`medseg.distributed.comm.channel`).

Rank 0 binds a socket on the job's own address (:func:`own_address`, :func:`listen_on`), never
every interface, and announces ``{"host", "port"}`` as JSON signed with the job secret
(:mod:`medseg.distributed.comm.auth`). Two ways carry it:

- :func:`rendezvous_address`: through ``horovodrun``'s rendezvous server
  (:mod:`medseg.distributed.comm.rendezvous_kv`), with no Horovod call, so the channel can be built
  while ``hvd.init()`` runs;
- :func:`share_address`: one Horovod broadcast after ``hvd.init()`` (a job launched without that server).

Either way a rank refuses an address whose MAC does not check out with its own secret.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from medseg.distributed.comm import auth, rendezvous_kv, wire
from medseg.errors import RunError

ADDRESS_KEY = "channel-address"  # the store address's key on horovodrun's rendezvous server
ADDRESS_SLOTS = 1024  # int32 slots of the announced store address (length, then MAC'd JSON bytes)


def own_address() -> str:
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


def listen_on(host: str) -> socket.socket:
    """A listening socket on ``host`` only (not every interface), for the store to take over."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(256)
    return sock


def _signed_address(secret: bytes, where: tuple[str, int], launch: str = "") -> bytes:
    """The store address as a MAC'd JSON message (what every way of announcing it carries); the MAC
    also covers ``launch``, so a value signed for another launch with the same secret is refused."""
    return auth.sign(secret, _domain(launch), wire.encode_json({"host": where[0], "port": where[1]}))


def _domain(launch: str) -> bytes:
    return b"channel-address" + (b"@" + launch.encode() if launch else b"")


def _verified_address(secret: bytes, signed: bytes, launch: str = "") -> tuple[str, int]:
    """The address in rank 0's message; refused unless its MAC checks out with the job secret."""
    data = auth.verify(secret, _domain(launch), signed)
    if data is None:
        raise RunError(
            "rank 0 announced the channel's store address without a valid job-secret MAC (a rank started "
            f"with another {auth.SECRET_ENV}, a value left from another launch, or tampering on the way); refused"
        )
    value = wire.decode_json(data, "channel-address", "rank 0")
    return str(value["host"]), int(value["port"])


def share_address(hvd: Any, secret: bytes, where: tuple[str, int] | None) -> tuple[str, int]:
    """Rank 0's store address on every rank: one Horovod broadcast of int32 slots holding the
    MAC'd JSON message (length first); refused unless the MAC checks out with the job secret."""
    buf = torch.zeros(ADDRESS_SLOTS, dtype=torch.int32)
    if where is not None:
        signed = _signed_address(secret, where)
        buf[0] = len(signed)
        buf[1 : 1 + len(signed)] = torch.tensor(list(signed), dtype=torch.int32)
    buf = hvd.broadcast(buf, root_rank=0, name="medseg.channel")
    n = int(buf[0])
    raw = bytes(int(x) & 0xFF for x in buf[1 : 1 + n].tolist()) if 0 < n < ADDRESS_SLOTS else b""
    return _verified_address(secret, raw)


def rendezvous_address(
    server: tuple[str, int], secret: bytes, where: tuple[str, int] | None, timeout_s: float, size: int
) -> tuple[str, int]:
    """Rank 0's store address on every rank through ``horovodrun``'s rendezvous server
    (:mod:`~medseg.distributed.comm.rendezvous_kv`): rank 0 puts the MAC'd message, the others wait
    for it; refused unless the MAC checks out for this launch (the server's address and the job's
    ``size``: each launch has its own server). Needs no Horovod call, so it runs beside ``hvd.init()``."""
    launch = f"{server[0]}:{server[1]}/{size}"
    if where is not None:
        rendezvous_kv.put(server, ADDRESS_KEY, _signed_address(secret, where, launch))
        return where
    return _verified_address(secret, rendezvous_kv.wait_for(server, ADDRESS_KEY, timeout_s), launch)


def use_job_interface() -> None:
    """Gloo's sockets on Horovod's interface, where the launcher names one. Call it before any thread
    that may read the environment starts (``setenv`` beside a reader is unsafe)."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.environ.get("HOROVOD_GLOO_IFACE"):
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["HOROVOD_GLOO_IFACE"]
