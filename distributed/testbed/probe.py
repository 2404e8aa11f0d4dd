"""Measurements of the emulated WAN between two sites: TCP round-trip times, throughput and reachability,
and the probe that checks them against the WAN's spec.

Every socket is opened inside a site's namespace (:func:`~medseg.distributed.testbed.netns.socket_in`)
and used from this process, so both ends of a measurement are threads of one process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from medseg.distributed.testbed.netns import socket_in
from medseg.distributed.testbed.spec import Site, SitesError, WanSpec

log = logging.getLogger(__name__)

TOLERANCE = 0.10  # the probe's allowed relative error
RTT_FLOOR_MS = 0.5  # ... but never below this many ms (the probe's own cost at tiny delays)
TCP_GOODPUT = 1448 / 1514  # TCP payload per Ethernet frame (timestamps on): goodput vs tbf rate
# Through the site link: inner MTU 1420 (1368 bytes of TCP payload with timestamps) in a 1480-byte
# UDP packet (IPv4 + UDP + WireGuard's 32 bytes), 1494 on the veth.
TUNNEL_GOODPUT = 1368 / 1494


@contextlib.contextmanager
def realtime_thread(priority: int = 10) -> Iterator[None]:
    """Run the calling thread SCHED_FIFO for the block (root only; otherwise unchanged).

    The RTT probe times 1-byte exchanges between two threads of this process; on a loaded machine
    every wake-up of a normal thread waits for a time slice, which adds milliseconds to each RTT
    that the link does not have.
    """
    try:
        old = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, old[0], old[1])


def _echo(server: socket.socket, count: int, timeout: float) -> None:
    """Accept one connection and answer each of its first ``count + 1`` bytes with one byte."""
    c, _ = server.accept()
    with c:
        c.settimeout(timeout)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count + 1):
            if not c.recv(1):
                return
            c.sendall(b"y")


def tcp_rtt_ms(
    src: Site, dst: Site, count: int = 30, timeout: float = 5.0, addr: str | None = None
) -> list[float]:
    """Round-trip times (ms) of ``count`` 1-byte TCP request/responses (TCP_NODELAY) from src to dst
    (at ``addr``: default its WAN address ``dst.ip``).

    Both ends run real-time (:func:`realtime_thread`), like the relay, so that the figure is the
    link's and not the scheduler's."""
    addr = addr or dst.ip
    server = socket_in(dst.netns)
    client = socket_in(src.netns)
    try:
        server.bind((addr, 0))
        server.listen(1)
        server.settimeout(timeout)
        port = server.getsockname()[1]
        errors: list[BaseException] = []

        def echo() -> None:
            try:
                with realtime_thread():
                    _echo(server, count, timeout)
            except OSError as exc:
                errors.append(exc)

        th = threading.Thread(target=echo, daemon=True)
        th.start()
        client.settimeout(timeout)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            client.connect((addr, port))
            rtts = []
            with realtime_thread():
                for i in range(count + 1):
                    t0 = time.perf_counter()
                    client.sendall(b"x")
                    if not client.recv(1):
                        raise SitesError(f"probe: {dst.hostname} closed the connection")
                    if i:  # the first exchange also pays the connection's set-up on the server side
                        rtts.append((time.perf_counter() - t0) * 1000)
        except OSError as exc:
            raise SitesError(
                f"probe: no TCP exchange from {src.hostname} to {dst.hostname} ({addr}): {exc}"
            ) from None
        th.join(timeout)
        return rtts
    finally:
        client.close()
        server.close()


def _receive(
    server: socket.socket, timeout: float, warmup: float, max_bytes: int, result: dict[str, float]
) -> None:
    """Accept one flow and read it to its end; fills ``result`` (see :func:`tcp_throughput`)."""
    c, _ = server.accept()
    with c:
        c.settimeout(timeout)
        total = 0
        first = mark = None
        marked = 0
        last = time.perf_counter()
        while True:
            data = c.recv(1 << 16)
            now = time.perf_counter()
            if not data:
                break
            total += len(data)
            last = now
            if first is None:
                first = now
            elif mark is None and (now - first >= warmup or total >= max_bytes // 4):
                mark, marked = now, total
        result["bytes"] = total
        if mark is not None and last > mark:
            result["seconds"] = last - mark
            result["mbit_s"] = (total - marked) * 8 / (last - mark) / 1e6


def tcp_throughput(
    src: Site,
    dst: Site,
    seconds: float = 3.0,
    warmup: float = 0.5,
    max_bytes: int = 1 << 30,
    timeout: float = 10.0,
    addr: str | None = None,
) -> dict[str, float]:
    """One TCP flow src -> dst (at ``addr``: default ``dst.ip``) for ``seconds`` (or ``max_bytes``);
    rate measured at the receiver.

    The receiver's clock runs from ``warmup`` seconds after the first byte (slow start excluded), or
    from the first quarter of ``max_bytes`` when that comes sooner (an unshaped link can carry all of
    ``max_bytes`` within the warm-up), to the last byte; returns ``mbit_s``, ``bytes`` (all received) and ``seconds`` (the measured span).
    """
    addr = addr or dst.ip
    server = socket_in(dst.netns)
    client = socket_in(src.netns)
    result: dict[str, float] = {}
    try:
        server.bind((addr, 0))
        server.listen(1)
        server.settimeout(timeout)
        port = server.getsockname()[1]
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                _receive(server, timeout, warmup, max_bytes, result)
            except OSError as exc:
                errors.append(exc)

        th = threading.Thread(target=receive, daemon=True)
        th.start()
        client.settimeout(timeout)
        chunk = b"\0" * (1 << 16)
        sent = 0
        try:
            client.connect((addr, port))
            end = time.perf_counter() + seconds
            while sent < max_bytes and time.perf_counter() < end:
                client.sendall(chunk)
                sent += len(chunk)
            client.shutdown(socket.SHUT_WR)
        except OSError as exc:
            raise SitesError(f"probe: TCP flow from {src.hostname} to {dst.hostname} failed: {exc}") from None
        th.join(timeout + seconds)
        if errors or "mbit_s" not in result:
            raise SitesError(
                f"probe: the receiver at {dst.hostname} measured nothing ({errors or 'too few bytes'})"
            )
        return result
    finally:
        client.close()
        server.close()


def tcp_connect_error(src: Site, dst: Site, timeout: float = 2.0, addr: str | None = None) -> OSError | None:
    """None when a TCP connection from src to dst's address (``addr``, default ``dst.ip``) is set up
    within ``timeout`` seconds, else why not (a timeout or "unreachable" for a cut link; a refusal
    would mean dst was reached)."""
    addr = addr or dst.ip
    server = socket_in(dst.netns)
    client = socket_in(src.netns)
    try:
        server.bind((addr, 0))
        server.listen(1)
        client.settimeout(timeout)
        try:
            client.connect((addr, server.getsockname()[1]))
        except OSError as exc:
            return exc
        return None
    finally:
        client.close()
        server.close()


def tcp_connects(src: Site, dst: Site, timeout: float = 2.0, addr: str | None = None) -> bool:
    """True when a TCP connection from src to dst's address is set up within ``timeout`` seconds."""
    return tcp_connect_error(src, dst, timeout, addr) is None


def probe_rtt_share(rtt_ms: float) -> float:
    """The share of a path's rate one TCP flow keeps under this kernel's congestion control.

    BBR (Cardwell et al., "BBR: Congestion-Based Congestion Control", ACM Queue 2016) enters
    ProbeRTT every 10 s and holds its window at 4 packets for max(200 ms, one round trip): on a
    50 ms path that costs 2 % of the rate, on a time-dilated path with a 1 s round trip about 10 %.
    Its timers are wall-clock constants that time dilation does not stretch. Other congestion
    controls: 1.
    """
    try:
        cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        cc = ""
    if cc != "bbr":
        return 1.0
    return 1.0 - max(200.0, rtt_ms) / 10_000.0


def rate_ok(wan: WanSpec, mbit_s: float) -> bool:
    """Whether a measured throughput is within the tolerance of what one TCP flow keeps of the
    WAN's rate (:func:`probe_rtt_share` of its round trip)."""
    exp = expected_mbit_s(wan)
    return abs(mbit_s - exp) <= TOLERANCE * exp


def expected_mbit_s(wan: WanSpec) -> float:
    """The WAN's rate less what BBR's ProbeRTT costs on its round trip (:func:`probe_rtt_share`)."""
    assert wan.rate_bit is not None
    return wan.rate_bit / 1e6 * probe_rtt_share(2 * wan.delay_ms)


def _problems(wan: WanSpec, rtt: float, mbit_s: float) -> list[str]:
    """What of a measured RTT and throughput is off the WAN's spec (empty when it measures as specified);
    ``mbit_s`` as plain TCP would see it (a tunnel's goodput scaled by TCP_GOODPUT / TUNNEL_GOODPUT)."""
    problems = []
    exp_rtt = 2 * wan.delay_ms
    if wan.needs_relay or wan.rate_bit:
        allowed = max(TOLERANCE * exp_rtt, RTT_FLOOR_MS)
        if abs(rtt - exp_rtt) > allowed:
            problems.append(f"RTT {rtt:.2f} ms, expected {exp_rtt:g} ms +- {allowed:.2f}")
    if wan.rate_bit:
        exp = wan.rate_bit / 1e6
        if wan.loss > 0:  # what TCP makes of loss depends on its congestion control
            if mbit_s > exp * (1 + TOLERANCE):
                problems.append(f"throughput {mbit_s:.2f} Mbit/s above the rate {exp:g}")
        elif not rate_ok(wan, mbit_s):
            problems.append(
                f"throughput {mbit_s:.2f} Mbit/s, expected {expected_mbit_s(wan):.4g} +- {TOLERANCE:.0%} "
                f"(the rate {exp:g} less BBR's ProbeRTT share)"
            )
    return problems


def probe_wan(
    wan: WanSpec, a: Site, b: Site, check: bool = True, seconds: float = 3.0, tunnel: bool = False
) -> dict:
    """Measure RTT and throughput from site ``a`` to site ``b`` against the WAN's spec.

    ``tunnel``: between the sites' tunnel addresses (the site link), whose TCP goodput is
    TUNNEL_GOODPUT of the rate (about 4 % less than plain TCP's): the rate check allows for it.

    RTT: median of 30 one-byte TCP request/responses (TCP_NODELAY); expected 2 x one-way
    delay. Throughput: one TCP flow for ``seconds`` (slow start's first 0.5 s not counted),
    timed at the receiver, and a second flow when the first is off (the better one counts: a
    congestion event inside 3 s can cost a few per cent); expected the tbf rate. TCP's payload is
    1448 of every 1514 bytes on the wire, so goodput runs about 4.4 % under the rate: within the
    10 % allowance. With loss, what TCP achieves depends on its congestion control (CUBIC keeps
    far more of the rate than Reno), so then only "not above the rate" is checked. ``ok`` is
    False when a checked value is more than 10 % off (0.5 ms at least for RTT); with ``check``
    that raises SitesError.
    """
    addr = b.tunnel_ip if tunnel else b.ip
    scale = TCP_GOODPUT / TUNNEL_GOODPUT if tunnel else 1.0  # the tunnel's goodput as plain TCP's
    rtt_s = 2 * wan.delay_ms / 1000
    # 30 exchanges (10 on a path whose round trip is over half a second), each given 5 s beyond it
    rtts = tcp_rtt_ms(a, b, count=30 if rtt_s < 0.5 else 10, timeout=5.0 + 2 * rtt_s, addr=addr)
    # slow start doubles the window once per round trip: on a long path (a dilated link's RTT is
    # seconds) the flow needs several round trips to fill the path, and many more to be timed
    warmup, seconds = max(0.5, 5 * rtt_s), max(seconds, 20 * rtt_s)
    timeout = 10.0 + 10 * rtt_s  # a loss on a long path can stall a flow for several RTOs
    flows = [tcp_throughput(a, b, seconds=seconds, addr=addr, warmup=warmup, timeout=timeout)]
    if wan.rate_bit and not wan.loss and not rate_ok(wan, flows[0]["mbit_s"] * scale):
        # one congestion event in a 3 s flow can cost a few per cent: the link's rate is the
        # better of two flows (both reported), and a shaping that is really off fails both
        flows.append(tcp_throughput(a, b, seconds=seconds, addr=addr, warmup=warmup, timeout=timeout))
    flow = max(flows, key=lambda f: f["mbit_s"])
    goodput = TUNNEL_GOODPUT if tunnel else TCP_GOODPUT
    rtt = statistics.median(rtts)
    exp_rtt = 2 * wan.delay_ms
    report: dict = {
        "src": a.name,
        "dst": b.name,
        "path": "tunnel" if tunnel else "wan",
        "wan": str(wan),
        "rtt_ms": round(rtt, 3),
        "rtt_ms_p10_p90": [round(x, 3) for x in statistics.quantiles(rtts, n=10)[::8]],
        "expected_rtt_ms": exp_rtt,
        "mbit_s": round(flow["mbit_s"], 3),
        "expected_mbit_s": expected_mbit_s(wan) if wan.rate_bit else None,
        "tcp_goodput_mbit_s": round(wan.rate_bit * goodput / 1e6, 3) if wan.rate_bit else None,
        "flow_seconds": round(flow["seconds"], 3),
        "flows_mbit_s": [round(f["mbit_s"], 3) for f in flows],
        "tolerance": TOLERANCE,
    }
    problems = _problems(wan, rtt, flow["mbit_s"] * scale)
    report["ok"] = not problems
    report["problems"] = problems
    log.info(
        "sites probe %s -> %s (%s): RTT %.2f ms (expected %g), %.2f Mbit/s (expected %s)%s",
        a.name,
        b.name,
        report["path"],
        rtt,
        exp_rtt,
        flow["mbit_s"],
        report["expected_mbit_s"],
        "" if not problems else ": " + "; ".join(problems),
    )
    if check and problems:
        raise SitesError(
            f"the WAN {wan} does not measure as specified ({'; '.join(problems)}); "
            "is the machine overloaded? see `medseg sites probe --report-only`"
        )
    return report
