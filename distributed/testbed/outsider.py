"""An outsider on the emulated WAN, to check the site link: an attacker host on the router, port
scans of a site's WAN address, packet captures on the WAN, and a known byte pattern sent between sites.

The attacker (:func:`attacker`) is a namespace ``msite-wan-atk`` (a name no site can have) on the
router like a site: its ``atk0`` 198.18.250.1/24 <-> the router's ``to-wan-atk`` 198.18.250.254
(sites use 198.18.1-200.x). A policy rule sends the sites' answers to it straight back (not through
the relay), so a scan of all 65535 ports is not slowed by the emulated delay; it is a host on the WAN
all the same. It goes with its context, and the testbed's sweep removes it too (its name starts with
``msite-``). Scans and sends run in threads that entered a namespace (:func:`.netns.call_in`); every
loop is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from medseg.distributed.testbed.host import run
from medseg.distributed.testbed.netns import call_in, in_netns, socket_in
from medseg.distributed.testbed.spec import ROUTER_NS, Site, SitesError

ATTACKER_NS = "msite-wan-atk"
ATTACKER_DEV = "to-wan-atk"  # the router's end
ATTACKER_IP = "198.18.250.1"
ATTACKER_GW = "198.18.250.254"
_RULE_PRIO = 900  # ahead of the sites' WAN rules (1000 + 10 x index)


@contextlib.contextmanager
def attacker() -> Iterator[str]:
    """A host on the WAN side (see the module's docstring); yields its namespace, removed after."""
    ns, r = ATTACKER_NS, ROUTER_NS
    try:
        run(f"ip netns add {ns}")
        run(f"ip -n {ns} link set lo up")
        run(f"ip -n {r} link add {ATTACKER_DEV} type veth peer name atk0 netns {ns}")
        run(f"ip -n {ns} addr add {ATTACKER_IP}/24 dev atk0")
        run(f"ip -n {ns} link set atk0 up")
        run(f"ip -n {ns} route add 198.18.0.0/15 via {ATTACKER_GW} dev atk0")
        run(f"ip -n {r} addr add {ATTACKER_GW}/24 dev {ATTACKER_DEV}")
        run(f"ip -n {r} link set {ATTACKER_DEV} up")
        run(f"ip -n {r} rule add prio {_RULE_PRIO} to 198.18.250.0/24 lookup main")
        yield ns
    finally:
        run(["ip", "-n", r, "rule", "del", "prio", str(_RULE_PRIO)], check=False)
        run(["ip", "netns", "del", ns], check=False)  # takes the veth pair with it


def allow_icmp_errors(netns: str) -> None:
    """Lift the kernel's ICMP rate limits in ``netns`` so a UDP scan hears "port unreachable" from
    every closed port (by default Linux answers about one per second to one host)."""
    run(
        f"ip netns exec {netns} sysctl -q -w net.ipv4.icmp_ratelimit=0 "
        "net.ipv4.icmp_msgs_per_sec=1000000 net.ipv4.icmp_msgs_burst=1000000"
    )


def _batches(ports: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for i in range(0, len(ports), size):
        yield ports[i : i + size]


def _tcp_batch(addr: str, ports: Sequence[int], timeout: float, out: dict[str, list[int]]) -> None:
    """Non-blocking connects to ``ports`` at once; each ends open (connected), closed (RST) or
    filtered (no answer in ``timeout`` s, or unreachable)."""
    socks: dict[int, tuple[socket.socket, int]] = {}
    poller = select.poll()
    try:
        for port in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, no TIME_WAIT
            s.setblocking(False)
            socks[s.fileno()] = (s, port)
            err = s.connect_ex((addr, port))
            if err in (0, errno.EINPROGRESS):
                poller.register(s, select.POLLOUT | select.POLLERR | select.POLLHUP)
            else:
                out["filtered"].append(port)
                del socks[s.fileno()]
                s.close()
        pending = set(socks)
        end = time.monotonic() + timeout
        while pending and time.monotonic() < end:
            for fd, _ in poller.poll(max(1, int((end - time.monotonic()) * 1000))):
                s, port = socks[fd]
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                kind = "open" if err == 0 else "closed" if err == errno.ECONNREFUSED else "filtered"
                out[kind].append(port)
                poller.unregister(fd)
                pending.discard(fd)
        out["filtered"] += [socks[fd][1] for fd in pending]
    finally:
        for s, _ in socks.values():
            s.close()


def scan_tcp(
    netns: str, addr: str, ports: Iterable[int], batch: int = 512, timeout: float = 2.0, retries: int = 2
) -> dict[str, list[int]]:
    """A TCP connect scan of ``addr`` from namespace ``netns``: ports ``open``, ``closed``, ``filtered``.

    A shaped link that is also carrying a job drops some of a 512-SYN burst (or the RSTs that answer
    it); as nmap does, a port left unanswered is probed again, up to ``retries`` more times in
    batches of 32, before it is called filtered."""
    ports = sorted(set(ports))
    out: dict[str, list[int]] = {"open": [], "closed": [], "filtered": []}

    def work() -> None:
        for chunk in _batches(ports, batch):
            _tcp_batch(addr, chunk, timeout, out)
        for _ in range(retries):
            again, out["filtered"] = out["filtered"], []
            for chunk in _batches(sorted(again), 32):
                _tcp_batch(addr, chunk, timeout, out)

    call_in(netns, work)
    return {k: sorted(v) for k, v in out.items()}


def _udp_batch(
    addr: str, ports: Sequence[int], quiet: float, timeout: float, out: dict[str, list[int]]
) -> None:
    """One datagram to each port at once; "port unreachable" marks it closed, a reply answered, and
    silence (``quiet`` s after the last answer, at most ``timeout`` s) open|filtered."""
    socks: dict[int, tuple[socket.socket, int]] = {}
    poller = select.poll()
    try:
        for port in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setblocking(False)
            s.connect((addr, port))  # a connected UDP socket reports the ICMP error on its next recv
            socks[s.fileno()] = (s, port)
            poller.register(s, select.POLLIN | select.POLLERR)
            with contextlib.suppress(OSError):
                s.send(b"medseg-scan\n")
        pending = set(socks)
        end = time.monotonic() + timeout
        last = time.monotonic()
        while pending and time.monotonic() < min(end, last + quiet):
            events = poller.poll(50)
            for fd, _ in events:
                s, port = socks[fd]
                try:
                    s.recv(2048)
                    out["answered"].append(port)
                except ConnectionRefusedError:
                    out["closed"].append(port)
                except OSError:
                    out["silent"].append(port)
                poller.unregister(fd)
                pending.discard(fd)
            if events:
                last = time.monotonic()
        out["silent"] += [socks[fd][1] for fd in pending]
    finally:
        for s, _ in socks.values():
            s.close()


def scan_udp(
    netns: str,
    addr: str,
    ports: Iterable[int],
    batch: int = 256,
    quiet: float = 0.5,
    timeout: float = 3.0,
    retries: int = 2,
) -> dict[str, list[int]]:
    """A UDP scan of ``addr`` from ``netns``: ports ``closed`` (ICMP port unreachable), ``answered``
    (a datagram came back) and ``silent`` (open, or filtered: WireGuard answers nothing to a stranger).
    Lift the target's ICMP rate limit first (:func:`allow_icmp_errors`), or closed ports look silent.
    As nmap does, a silent port is probed again, up to ``retries`` more times, before it is called
    silent: a datagram or its ICMP answer can be lost (a batch of 256 at once through a slow link's
    queue), which is no answer from the port."""
    ports = sorted(set(ports))
    out: dict[str, list[int]] = {"closed": [], "answered": [], "silent": []}

    def work() -> None:
        for chunk in _batches(ports, batch):
            _udp_batch(addr, chunk, quiet, timeout, out)
        for _ in range(retries):
            again, out["silent"] = out["silent"], []
            for chunk in _batches(sorted(again), batch):
                _udp_batch(addr, chunk, quiet, timeout, out)

    call_in(netns, work)
    return {k: sorted(v) for k, v in out.items()}


@contextlib.contextmanager
def capture(
    netns: str, dev: str, path: Path, max_packets: int = 100_000, max_seconds: float = 120.0
) -> Iterator[Path]:
    """``tcpdump -w path`` on ``dev`` in ``netns`` (whole packets) while the context runs, at most
    ``max_packets`` packets and ``max_seconds`` s; the file is complete when the context ends."""
    argv = in_netns(
        netns, "timeout", str(int(max_seconds)), "tcpdump", "-i", dev, "-n", "-s", "0", "-U",
        "-Z", "root", "-c", str(max_packets), "-w", str(path),
    )  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stderr is not None
        end, said = time.monotonic() + 10, b""
        while b"listening on" not in said:  # tcpdump says so once its capture is open
            if proc.poll() is not None or time.monotonic() > end:
                raise SitesError(
                    f"tcpdump on {dev} in {netns} did not start: {said.decode(errors='replace')}"
                )
            if select.select([proc.stderr], [], [], 0.2)[0]:
                said += proc.stderr.read1(4096)  # type: ignore[attr-defined]
        yield path
        time.sleep(0.5)  # the last packets reach the file (-U writes each packet at once)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def pcap_packets(path: Path) -> list[bytes]:
    """The IPv4 packets of a pcap file (Ethernet, Linux cooked or raw IP link types)."""
    data = path.read_bytes()
    if len(data) < 24:
        return []
    magic = data[:4]
    endian = "<" if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1") else ">"
    link = struct.unpack(endian + "I", data[20:24])[0]
    skip = {1: 14, 113: 16, 101: 0, 228: 0, 12: 0}.get(link)
    if skip is None:
        raise SitesError(f"{path}: link type {link} is not one this reader knows")
    packets, off = [], 24
    while off + 16 <= len(data):
        incl = struct.unpack(endian + "I", data[off + 8 : off + 12])[0]
        frame = data[off + 16 : off + 16 + incl]
        off += 16 + incl
        if link == 1 and frame[12:14] != b"\x08\x00":
            continue  # not IPv4 (ARP and the like)
        if link == 113 and frame[14:16] != b"\x08\x00":
            continue
        packet = frame[skip:]
        if packet and packet[0] >> 4 == 4:
            packets.append(packet)
    return packets


def flows(packets: Iterable[bytes]) -> dict[tuple[str, str, int, str, int], int]:
    """Packets per (protocol, source, source port, destination, destination port)."""
    out: dict[tuple[str, str, int, str, int], int] = {}
    for p in packets:
        ihl = (p[0] & 0x0F) * 4
        proto = {6: "tcp", 17: "udp", 1: "icmp"}.get(p[9], str(p[9]))
        sport = dport = 0
        if proto in ("tcp", "udp") and len(p) >= ihl + 4:
            sport, dport = struct.unpack("!HH", p[ihl : ihl + 4])
        key = (proto, socket.inet_ntoa(p[12:16]), sport, socket.inet_ntoa(p[16:20]), dport)
        out[key] = out.get(key, 0) + 1
    return out


def send_bytes(src: Site, dst: Site, addr: str, payload: bytes, timeout: float = 30.0) -> int:
    """Send ``payload`` over one TCP connection from site ``src`` to ``dst`` listening on ``addr``;
    returns the bytes ``dst`` received (all of them, or SitesError)."""
    server = socket_in(dst.netns)
    client = socket_in(src.netns)
    got: list[int] = []
    try:
        server.bind((addr, 0))
        server.listen(1)
        server.settimeout(timeout)

        def receive() -> None:
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(timeout)
                    n = 0
                    while chunk := conn.recv(1 << 16):
                        n += len(chunk)
                    got.append(n)

        th = threading.Thread(target=receive, daemon=True)
        th.start()
        client.settimeout(timeout)
        try:
            client.connect((addr, server.getsockname()[1]))
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
        except OSError as exc:
            raise SitesError(f"send from {src.hostname} to {addr} failed: {exc}") from None
        th.join(timeout)
        if got != [len(payload)]:
            raise SitesError(f"{dst.hostname} received {got or 'nothing'} of {len(payload)} bytes")
        return got[0]
    finally:
        client.close()
        server.close()
