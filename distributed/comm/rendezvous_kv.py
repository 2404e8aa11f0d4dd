"""Raw values through ``horovodrun``'s rendezvous server, the key-value store its Gloo ranks meet on.

Why. The channel's store address must reach every rank before the channel exists. A Horovod
broadcast can carry it only after ``hvd.init()``, whose own Gloo rendezvous takes tens of seconds
over slow links, and the broadcast then costs several more WAN round trips of Horovod's
coordination cycle. The rendezvous server is up before any rank starts (``horovodrun`` tells each
rank its address in ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT``), so rank 0 can PUT the address at once
and the others GET it while Horovod is still initialising: the channel is built *beside*
``hvd.init()`` instead of after it (:meth:`medseg.distributed.comm.channel.Channel.before_horovod`).

What travels. Bytes only, under a scope of medseg's own (:data:`SCOPE`), never Horovod's
``http_client`` (which unpickles what it reads). The server is reachable by whoever can reach the
ranks' network, so the caller signs what it puts and verifies what it gets
(:mod:`medseg.distributed.comm.auth`); medseg's launcher bounds a PUT's size
(:mod:`medseg.distributed.launch.hvdrun`). Requests go straight to the server with
:mod:`http.client`, never through an ``http_proxy`` a hospital's environment may set.

Waiting. A GET answered 404 means "not put yet", and one that goes unanswered may be a dropped
connection on a slow link: the reader asks again after a pause that doubles from
:data:`FIRST_PAUSE_S` up to :data:`MAX_PAUSE_S`, until its deadline; no request outlives it.

What it cannot stop. Anyone who reaches the server can overwrite a key: a forged or replayed value
is refused (the MAC, bound to this launch), so the job stops with a clear error instead of joining
the wrong store, but it does stop. The site tunnel (:mod:`medseg.distributed.secure.tunnel`) keeps
the server off the WAN.
"""

from __future__ import annotations

import http.client
import os
import time

from medseg.errors import RunError

SCOPE = "medseg"  # medseg's keys; Horovod's own scopes are "global", "local_<host>", "cross_<n>"
REQUEST_TIMEOUT_S = 30.0  # one request (a slow link's round trips, not a dead server's silence)
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 1.0
MAX_VALUE_BYTES = 64 * 1024  # a value read back (an address is tens of bytes)


def server_from_env() -> tuple[str, int] | None:
    """The rendezvous server ``horovodrun --gloo`` gave this rank, or ``None`` (not launched so)."""
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port or not port.isdigit():
        return None
    return addr, int(port)


def _request(
    server: tuple[str, int],
    method: str,
    key: str,
    body: bytes | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[int, bytes]:
    """One HTTP request for ``/SCOPE/key``; (status, body of at most MAX_VALUE_BYTES + 1 bytes).
    A server that cannot be reached or answers garbage raises :class:`Unanswered`."""
    conn = http.client.HTTPConnection(server[0], server[1], timeout=max(timeout_s, 0.1))
    try:
        conn.request(method, f"/{SCOPE}/{key}", body=body)
        resp = conn.getresponse()
        return resp.status, resp.read(MAX_VALUE_BYTES + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise Unanswered(
            f"Horovod's rendezvous server {server[0]}:{server[1]} did not answer {method} {key}: {exc!r}"
        ) from None
    finally:
        conn.close()


class Unanswered(RunError):
    """The rendezvous server could not be reached, or its answer was not HTTP."""


def put(server: tuple[str, int], key: str, value: bytes) -> None:
    """Store ``value`` under ``key``; a refusal (the launcher bounds a value's size) is an error."""
    status, _ = _request(server, "PUT", key, value)
    if status != 200:
        raise RunError(
            f"Horovod's rendezvous server refused medseg's {key!r} ({len(value)} bytes): HTTP {status}"
        )


def wait_for(server: tuple[str, int], key: str, timeout_s: float) -> bytes:
    """The value under ``key`` once some rank has put it; RunError after ``timeout_s`` without it.

    A request that goes unanswered (a dropped connection on a slow link) is asked again like a 404
    until the deadline, whose error then names the last failure; any other HTTP status is an error."""
    deadline = time.monotonic() + timeout_s
    pause = FIRST_PAUSE_S
    last = "not put yet"
    while True:
        left = deadline - time.monotonic()
        try:
            status, body = _request(server, "GET", key, timeout_s=min(REQUEST_TIMEOUT_S, left))
        except Unanswered as exc:
            status, body, last = 0, b"", str(exc)
        if status == 200:
            if len(body) > MAX_VALUE_BYTES:
                raise RunError(
                    f"Horovod's rendezvous server returned over {MAX_VALUE_BYTES} bytes for {key!r}"
                )
            return body
        if status not in (0, 404):
            raise RunError(f"Horovod's rendezvous server answered HTTP {status} for medseg's {key!r}")
        if time.monotonic() + pause > deadline:
            raise RunError(
                f"no rank put medseg's {key!r} on Horovod's rendezvous server within {timeout_s:.0f} s ({last})"
            )
        time.sleep(pause)
        pause = min(2 * pause, MAX_PAUSE_S)
