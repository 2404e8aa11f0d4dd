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
HOSTNAME NODE INTERVAL USER_TIMEOUT_MS``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

STOPPED = {"T", "t", "Z", "X", "x"}


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


def beat_record(rank: int, host: str, node: str) -> bytes:
    """The bytes of one beat (the same every time)."""
    return (json.dumps({"rank": rank, "host": host, "node": node, "ev": "alive"}) + "\n").encode()


def run(
    addr: tuple[str, int], rank: int, pid: int, host: str, node: str, interval: float, user_timeout_ms: int
) -> int:
    beat = beat_record(rank, host, node)
    sock = connect(addr, user_timeout_ms, budget_s=30.0)
    while sock is not None:
        if os.getppid() != pid:  # re-parented: the rank is gone
            return 0
        state = rank_state(pid)
        if state is None:
            return 0
        if state not in STOPPED:
            try:
                sock.sendall(beat)
            except OSError:
                sock.close()
                sock = connect(addr, user_timeout_ms, budget_s=5.0)
                continue
        time.sleep(interval)
    return 0


if __name__ == "__main__":
    h, port, r, p, hostname, nodename, every, uto = sys.argv[1:9]
    sys.exit(run((h, int(port)), int(r), int(p), hostname, nodename, float(every), int(uto)))
