"""A rank's liveness beats, sent by a small helper process instead of a thread of the rank.

Why a process: a Horovod rank can block inside Horovod with Python's GIL held. With 2 ranks under
``sync: bsp`` and rank 1 stopped (SIGSTOP) during a step, rank 0's main thread sits in
``horovod.torch.mpi_ops._allreduce_async`` (the enqueue called from a gradient hook) for as long as
rank 1 is stopped, and a beat thread of rank 0 cannot run. The launcher would then hear nothing
from *either* rank and could name rank 0, the healthy one, as the rank that stopped responding. A
beat from another process does not need the rank's GIL.

What a beat means: every ``interval`` seconds the helper reads the rank's scheduler state from
``/proc/<pid>/stat`` and sends ``{"rank", "host", "node", "ev": "alive"}`` unless the rank is
stopped (``T``, ``t``: SIGSTOP, a debugger), a zombie or gone. So a killed, frozen-by-signal or
cut-off rank falls silent (rule 1 of :class:`medseg.distributed.launch.heartbeat.Watchdog` names it),
while a rank that is only blocked waiting for another keeps beating. A rank that spins without
progress is still alive by this test; the watchdog's no-progress rule covers it.

The helper imports only the standard library (it starts in about 50 ms and holds a few MB), has its
own TCP connection to the launcher, and exits when the rank exits, when it is re-parented (the rank
died), or when the launcher cannot be reached for ``budget_s``. Beats carry no phase, so they never
change the phase the rank itself reported. Run as ``python -I -S beat_sidecar.py HOST PORT RANK PID
HOSTNAME NODE INTERVAL USER_TIMEOUT_MS``, with the job secret in ``MEDSEG_JOB_SECRET`` (hex).

The line format of every heartbeat (this helper's and the rank's own, :mod:`.heartbeat`), defined
here because this file may import only the standard library::

    <64 hex digits: HMAC-SHA256(job secret, "medseg-beat" NUL json)> SPACE <json> LF

at most :data:`MAX_LINE` bytes. The JSON object carries ``sid`` (a random id of the sending process)
and ``seq`` (1, 2, 3, ... per sender), so a line captured on the way and sent again is refused too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import sys
import time

STOPPED = {"T", "t", "Z", "X", "x"}
DOMAIN = b"medseg-beat\x00"
MAX_LINE = 64 * 1024  # bytes of one heartbeat line, newline included; longer ones are dropped
SECRET_ENV = "MEDSEG_JOB_SECRET"
MAC_HEX = 64


def line_mac(secret: bytes, body: bytes) -> bytes:
    """The hex HMAC-SHA256 that precedes ``body`` on a heartbeat line."""
    return hmac.new(secret, DOMAIN + body, hashlib.sha256).hexdigest().encode()


def signed_line(secret: bytes, record: dict) -> bytes:
    """``record`` as one heartbeat line (see the module docstring)."""
    body = json.dumps(record).encode()
    return line_mac(secret, body) + b" " + body + b"\n"


def opened_line(secret: bytes, line: bytes) -> bytes | None:
    """The JSON body of a heartbeat line (no newline) when its MAC is valid, else None."""
    tag, sep, body = line.partition(b" ")
    if not sep or len(tag) != MAC_HEX:
        return None
    return body if hmac.compare_digest(tag, line_mac(secret, body)) else None


class Sender:
    """One sending process's ``sid`` and running ``seq``, signing its records."""

    def __init__(self, secret: bytes) -> None:
        self.secret, self.sid, self.seq = secret, secrets.token_hex(8), 0

    def line(self, record: dict) -> bytes:
        self.seq += 1
        return signed_line(self.secret, {**record, "sid": self.sid, "seq": self.seq})


def rank_state(pid: int) -> str | None:
    """The rank's one-letter scheduler state from /proc (None: gone). Without /proc: 'R' while it exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat[stat.rindex(")") + 2]  # the command name may hold spaces and parentheses
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
            return "R"
        except OSError:
            return None


def connect(addr: tuple[str, int], user_timeout_ms: int, budget_s: float) -> socket.socket | None:
    deadline = time.time() + budget_s
    while time.time() < deadline:  # bounded
        try:
            sock = socket.create_connection(addr, timeout=10.0)
        except OSError:
            time.sleep(0.5)
            continue
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)
        return sock
    return None


def beat_record(rank: int, host: str, node: str) -> dict:
    """The record of one beat (the same every time; its line differs by ``seq`` and MAC)."""
    return {"rank": rank, "host": host, "node": node, "ev": "alive"}


def run(
    addr: tuple[str, int],
    rank: int,
    pid: int,
    host: str,
    node: str,
    interval: float,
    user_timeout_ms: int,
    secret: bytes,
) -> int:
    record, sender = beat_record(rank, host, node), Sender(secret)
    sock = connect(addr, user_timeout_ms, budget_s=30.0)
    while sock is not None:
        if os.getppid() != pid:  # re-parented: the rank is gone
            return 0
        state = rank_state(pid)
        if state is None:
            return 0
        if state not in STOPPED:
            try:
                sock.sendall(sender.line(record))
            except OSError:
                sock.close()
                sock = connect(addr, user_timeout_ms, budget_s=5.0)
                continue
        time.sleep(interval)
    return 0


if __name__ == "__main__":
    h, port, r, p, hostname, nodename, every, uto = sys.argv[1:9]
    try:
        key = bytes.fromhex(os.environ.get(SECRET_ENV, ""))
    except ValueError:
        key = b""
    if not key:
        sys.exit(f"beat helper: no job secret in {SECRET_ENV}; beats would be refused")
    sys.exit(run((h, int(port)), int(r), int(p), hostname, nodename, float(every), int(uto), key))
