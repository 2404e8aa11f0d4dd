"""Run as a rank by horovodrun (tests/distributed/test_rendezvous.py): where Horovod's rendezvous
server listens, and how it answers PUTs with a huge, a malformed and a small Content-Length."""

from __future__ import annotations

import http.client
import json
import os

ADDR, PORT = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"], int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])


def listening(port: int) -> list[str]:
    """Local addresses (hex, as the kernel writes them) of the TCP sockets listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                host, hex_port = local.split(":")
                if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
                    out.append(host)
    return out


def put(length: str, body: bytes = b"x") -> int | str:
    try:
        c = http.client.HTTPConnection(ADDR, PORT, timeout=10)
        c.putrequest("PUT", "/medsegtest/key")
        c.putheader("Content-Length", length)
        c.endheaders()
        c.send(body)
        return c.getresponse().status
    except OSError as exc:  # an unbounded server waits for the claimed body: the client times out
        return f"{type(exc).__name__}: {exc}"


print(
    json.dumps(
        {"addr": ADDR, "bound": listening(PORT), "huge": put(str(10**9)), "bad": put("x"), "ok": put("1")}
    )
)
