"""The WAN's delay and loss: a user-space relay between two TUN devices.

This kernel has no ``netem`` qdisc (and loads no modules), so the one-way delay and the random loss
of the emulated hospital network (:mod:`medseg.distributed.testbed.testbed`) are made here. The router
namespace routes every packet that a site sends to another site into the TUN device ``--tun-in``
(policy routing); this process reads it, holds it for ``--delay-ms`` and writes it out of
``--tun-out``, where the kernel receives it as if it had arrived on a wire and forwards it to the
destination site. A packet is dropped with probability ``--loss`` (a fraction, 0.001 = 0.1 %), or
when more than ``--max-queue`` packets are in flight (a bounded buffer, like a real router's).

Unequal links (``--link I=DELAY_MS:LOSS``, one per site index I): a packet from site i to site j is
also held for the delay of both sites' links, d_i + d_j, and survives each link's loss
independently, so its loss is 1 - (1 - l_i)(1 - l_j) (with ``--loss`` as a third, shared link).
Packets leave in the order they fall due (a heap; FIFO within one pair of sites, whose delay is
constant, so no flow is reordered).

A Python relay moves some 10^4-10^5 packets per second, so it is meant for WAN rates (up to a few
hundred Mbit/s), not for LAN speeds.

The process is bounded: it exits by itself after ``--max-seconds``, and cleanly (final counters
written) on SIGTERM or SIGINT. Every ``--stats-every`` seconds it writes per-site-pair byte and
packet counters as JSON to ``--stats`` (written to a temporary name and renamed), keyed
``"<src-octet>><dst-octet>"`` by the third octet of the IPv4 addresses, which is the site's index in
the testbed's 198.18.<i>.0/24 plan.

It imports only the standard library so that it also runs as a plain script
(``python3 distributed/testbed/relay.py ...``) without the package installed; installed, it is
``python -m medseg.distributed.testbed.relay``.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import logging
import os
import random
import select
import signal
import socket
import struct
import sys
import time

log = logging.getLogger("medseg.distributed.testbed.relay")

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
_READ_BATCH = 256  # packets read per wake-up at most, so writes are never starved


def open_tun(name: str) -> int:
    """Attach to the persistent TUN device ``name``; returns a non-blocking file descriptor.

    The device must exist already (made by ``ip tuntap add``): TUNSETIFF would otherwise create a
    new one, in whatever namespace this process happens to be in.
    """
    try:
        socket.if_nametoindex(name)
    except OSError:
        raise SystemExit(
            f"relay: no network device {name!r} in this namespace; create it with `ip tuntap add`"
        ) from None
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Counters:
    """Per site-pair bytes and packets, plus totals of what was read, written and dropped.

    ``tcp`` looks inside every IPv4 packet read (what the sites sent into the WAN): ``headers``
    (IP + TCP header bytes, options included), ``payload`` (TCP payload bytes), ``retrans_payload``
    / ``retrans_packets`` (payload bytes whose sequence numbers this flow had sent before: TCP
    retransmissions, e.g. after a tbf queue dropped a burst), ``pure_acks`` (segments without
    payload) and ``other`` (bytes of non-TCP packets). A segment is a retransmission as far as its
    sequence range ends at or below the highest end seen on its flow (modulo 2**32).
    """

    def __init__(self) -> None:
        self.pairs: dict[str, list[int]] = {}
        self.read = [0, 0]
        self.written = [0, 0]
        self.dropped_loss = [0, 0]
        self.dropped_queue = [0, 0]
        self.tcp = dict.fromkeys(
            ("headers", "payload", "retrans_payload", "retrans_packets", "pure_acks", "other"), 0
        )
        self._seq_end: dict[bytes, int] = {}

    def inspect(self, pkt: bytes) -> None:
        """Add one packet read from the WAN's input to :attr:`tcp`."""
        if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[9] != 6:
            self.tcp["other"] += len(pkt)
            return
        ihl = (pkt[0] & 0x0F) * 4
        if len(pkt) < ihl + 20:
            self.tcp["other"] += len(pkt)
            return
        total = min(struct.unpack_from("!H", pkt, 2)[0], len(pkt))
        thl = (pkt[ihl + 12] >> 4) * 4
        length = max(total - ihl - thl, 0)
        self.tcp["headers"] += total - length
        self.tcp["payload"] += length
        if not length:
            self.tcp["pure_acks"] += 1
            return
        flow = pkt[12:20] + pkt[ihl : ihl + 4]  # addresses and ports
        seq = struct.unpack_from("!I", pkt, ihl + 4)[0]
        end = (seq + length) & 0xFFFFFFFF
        high = self._seq_end.get(flow)
        if high is None:
            self._seq_end[flow] = end
            return
        ahead = ((end - high + 2**31) & 0xFFFFFFFF) - 2**31  # signed distance, modulo 2**32
        if ahead < length:
            self.tcp["retrans_payload"] += length - max(ahead, 0)
            self.tcp["retrans_packets"] += 1
        if ahead > 0:
            self._seq_end[flow] = end

    def pair(self, pkt: bytes) -> None:
        if len(pkt) >= 20 and pkt[0] >> 4 == 4:
            key = f"{pkt[14]}>{pkt[18]}"
            slot = self.pairs.setdefault(key, [0, 0])
            slot[0] += len(pkt)
            slot[1] += 1

    def as_dict(self) -> dict:
        def bp(v: list[int]) -> dict[str, int]:
            return {"bytes": v[0], "packets": v[1]}

        return {
            "time": time.time(),
            "read": bp(self.read),
            "written": bp(self.written),
            "dropped_loss": bp(self.dropped_loss),
            "dropped_queue": bp(self.dropped_queue),
            "pairs": {k: bp(v) for k, v in sorted(self.pairs.items())},
            "tcp": dict(self.tcp),
        }


def write_stats(path: str | None, counters: Counters) -> None:
    """Write the counters as JSON to ``path`` (via a temporary name, so readers never see half a file)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(counters.as_dict(), f)
    os.replace(tmp, path)


class Links:
    """The delay (s) and loss of a packet by its source and destination site (module docstring)."""

    def __init__(
        self, delay_ms: float, loss: float, links: dict[int, tuple[float, float]] | None = None
    ) -> None:
        self.delay, self.loss = delay_ms / 1000.0, loss
        self.links = {i: (d / 1000.0, lo) for i, (d, lo) in (links or {}).items()}
        self._paths: dict[tuple[int, int], tuple[float, float]] = {}

    def path(self, pkt: bytes) -> tuple[float, float]:
        """(delay in s, loss) of this IPv4 packet; the shared link's alone for anything else."""
        if not self.links or len(pkt) < 20 or pkt[0] >> 4 != 4:
            return self.delay, self.loss
        key = (pkt[14], pkt[18])  # third octets: the sites' indices
        if key not in self._paths:
            (d_src, l_src), (d_dst, l_dst) = (self.links.get(i, (0.0, 0.0)) for i in key)
            survive = (1.0 - self.loss) * (1.0 - l_src) * (1.0 - l_dst)
            self._paths[key] = (self.delay + d_src + d_dst, 1.0 - survive)
        return self._paths[key]


Queue = list[tuple[float, int, bytes]]  # a heap of (due time, arrival number, packet)


def _queue_arrivals(
    fd_in: int,
    queue: Queue,
    counters: Counters,
    rng: random.Random,
    links: Links,
    max_queue: int,
    now: float,
) -> None:
    """Read what waits on ``fd_in`` (at most ``_READ_BATCH`` packets): each is dropped with its
    path's loss, or when ``max_queue`` packets are in flight, or else queued to leave after its
    path's delay."""
    for _ in range(_READ_BATCH):
        try:
            pkt = os.read(fd_in, 65536)
        except BlockingIOError:
            break
        counters.read[0] += len(pkt)
        counters.read[1] += 1
        counters.inspect(pkt)
        delay, loss = links.path(pkt)
        if loss > 0.0 and rng.random() < loss:
            counters.dropped_loss[0] += len(pkt)
            counters.dropped_loss[1] += 1
        elif len(queue) >= max_queue:
            counters.dropped_queue[0] += len(pkt)
            counters.dropped_queue[1] += 1
        else:
            heapq.heappush(queue, (now + delay, counters.read[1], pkt))


def _send_due(fd_out: int, queue: Queue, counters: Counters, now: float) -> None:
    """Write every queued packet whose time has come out of ``fd_out``, in the order they fall due."""
    while queue and queue[0][0] <= now:
        pkt = heapq.heappop(queue)[2]
        try:
            os.write(fd_out, pkt)
        except OSError as exc:  # the output link is down (a cut) or full: the packet is lost
            log.debug("relay: write failed: %s", exc)
            counters.dropped_queue[0] += len(pkt)
            counters.dropped_queue[1] += 1
            continue
        counters.written[0] += len(pkt)
        counters.written[1] += 1
        counters.pair(pkt)


def run(
    tun_in: str,
    tun_out: str,
    delay_ms: float,
    loss: float,
    max_seconds: float,
    max_queue: int = 20000,
    stats: str | None = None,
    stats_every: float = 0.5,
    seed: int | None = None,
    links: dict[int, tuple[float, float]] | None = None,
) -> Counters:
    """Relay packets from ``tun_in`` to ``tun_out`` after ``delay_ms`` (plus their sites' ``links``:
    index -> (delay ms, loss)); returns the final counters."""
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True
        log.info("relay: signal %d, stopping", signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rng = random.Random(seed)
    fd_in, fd_out = open_tun(tun_in), open_tun(tun_out)
    paths = Links(delay_ms, loss, links)
    queue: Queue = []
    counters = Counters()
    start = time.monotonic()
    deadline = start + max_seconds
    next_stats = start
    log.info(
        "relay %s -> %s: delay %.3f ms, loss %.4g, site links %s, at most %.0f s",
        tun_in,
        tun_out,
        delay_ms,
        loss,
        links or "none",
        max_seconds,
    )
    try:
        while not stop:
            now = time.monotonic()
            if now >= deadline:
                log.info("relay: max lifetime of %.0f s reached, exiting", max_seconds)
                break
            wait = min(0.5, deadline - now, next_stats - now if stats else 0.5)
            if queue:
                wait = min(wait, queue[0][0] - now)
            readable, _, _ = select.select([fd_in], [], [], max(wait, 0.0))
            if readable:
                _queue_arrivals(fd_in, queue, counters, rng, paths, max_queue, time.monotonic())
            now = time.monotonic()
            _send_due(fd_out, queue, counters, now)
            if stats and now >= next_stats:
                write_stats(stats, counters)
                next_stats = now + stats_every
    finally:
        write_stats(stats, counters)
        os.close(fd_in)
        os.close(fd_out)
    return counters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Delay (and drop) packets between two TUN devices.")
    p.add_argument("--tun-in", required=True, help="TUN device whose packets are read")
    p.add_argument("--tun-out", required=True, help="TUN device the delayed packets are written to")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every packet")
    p.add_argument("--loss", type=float, default=0.0, help="drop probability, a fraction (0.001 = 0.1%%)")
    p.add_argument("--max-seconds", type=float, required=True, help="exit after this many seconds")
    p.add_argument("--max-queue", type=int, default=20000, help="packets in flight at most")
    p.add_argument("--stats", help="write JSON counters to this file")
    p.add_argument("--stats-every", type=float, default=0.5, help="seconds between counter writes")
    p.add_argument("--seed", type=int, help="seed of the loss draws")
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="I=DELAY_MS:LOSS",
        help="site index I's own link: its one-way delay and loss, added to every packet from or to it",
    )
    p.add_argument("--nice", type=int, default=-10, help="scheduling priority (root may go below 0)")
    p.add_argument(
        "--rt-priority", type=int, default=10, help="SCHED_FIFO priority (1-99; 0 = normal scheduling)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0.0 <= args.loss < 1.0 or args.delay_ms < 0 or args.max_seconds <= 0:
        p.error("need 0 <= --loss < 1, --delay-ms >= 0 and --max-seconds > 0")
    try:
        links = _parse_links(args.link)
    except ValueError as exc:
        p.error(str(exc))
    # Late relaying is extra delay on the emulated wire: run ahead of the training processes. A
    # real-time (SCHED_FIFO) relay is woken as soon as a packet arrives or falls due, whatever the
    # machine's load; it sleeps in select() otherwise, and the kernel's RT throttling
    # (sched_rt_runtime_us) keeps a share of every second for everyone else even if it did not.
    try:
        if args.rt_priority > 0:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_priority))
    except (OSError, AttributeError):
        log.warning("relay: no real-time scheduling (needs root); falling back to nice %d", args.nice)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    except OSError:
        log.warning("relay: could not set priority %d; delays may stretch under CPU load", args.nice)
    run(
        args.tun_in,
        args.tun_out,
        args.delay_ms,
        args.loss,
        args.max_seconds,
        args.max_queue,
        args.stats,
        args.stats_every,
        args.seed,
        links,
    )
    return 0


def _parse_links(items: list[str]) -> dict[int, tuple[float, float]]:
    """``["1=5:0", "2=25:0.001"]`` -> ``{1: (5.0, 0.0), 2: (25.0, 0.001)}``."""
    out = {}
    for item in items:
        index, _, rest = item.partition("=")
        delay, _, loss = rest.partition(":")
        try:
            i, d, lo = int(index), float(delay), float(loss or 0.0)
        except ValueError:
            raise ValueError(f"--link {item!r}: expected I=DELAY_MS:LOSS, e.g. 2=25:0") from None
        if not (0 <= i < 256 and d >= 0 and 0 <= lo < 1):
            raise ValueError(f"--link {item!r}: need 0 <= I < 256, DELAY_MS >= 0 and 0 <= LOSS < 1")
        out[i] = (d, lo)
    return out


if __name__ == "__main__":
    sys.exit(main())
