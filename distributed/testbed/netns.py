"""The testbed's network: namespaces, veth links, policy routes, tbf shaping, the relay's TUN devices,
and sockets opened inside a namespace.

The router namespace forwards between the sites' /24s. Packets that arrive from a site's link and
go to another site match a policy rule whose table routes only into the relay's TUN device
``wan-in``; the relay writes them out of ``wan-out`` after the WAN's delay, and the main table
forwards them on. Traffic to the launcher's /24 matches an earlier rule and never meets the relay.
Bandwidth is a tbf qdisc on both ends of every site link (tc shapes egress only).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from medseg.distributed.testbed.host import run, start_daemon
from medseg.distributed.testbed.spec import (
    IFACE,
    LAUNCHER_DEV,
    LAUNCHER_IP,
    LAUNCHER_TUNNEL_IP,
    NETWORK,
    PREFIX,
    ROUTER_NS,
    STATE_DIR,
    TUN_IN,
    TUN_OUT,
    WAN_TABLE,
    Network,
    Site,
    SitesError,
    WanSpec,
)

RELAY = Path(__file__).with_name("relay.py")
RELAY_STATS = STATE_DIR / "relay-stats.json"
RELAY_LOG = STATE_DIR / "relay.log"
T = TypeVar("T")


def in_netns(netns: str, *argv: str) -> list[str]:
    """argv that runs ``argv`` inside network namespace ``netns``."""
    return ["ip", "netns", "exec", netns, *argv]


def our_namespaces() -> list[str]:
    """The network namespaces of a testbed (named ``msite-*``) on this machine."""
    proc = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.startswith(PREFIX)]


def netns_pids(netns: str) -> set[int]:
    """The processes that live in network namespace ``netns``."""
    proc = run(["ip", "netns", "pids", netns], check=False)
    return {int(p) for p in proc.stdout.split() if p.isdigit()}


def link_stats(netns: str) -> dict[str, dict]:
    """``ip -s -j link show`` of a namespace, by interface name (flags and ``stats64`` counters)."""
    proc = run(["ip", "-n", netns, "-s", "-j", "link", "show"])
    return {d["ifname"]: d for d in json.loads(proc.stdout)}


def check_routes() -> None:
    """Refuse when the root namespace already routes part of 198.18.0.0/15 (not ours)."""
    for line in run(["ip", "-4", "route", "show"]).stdout.splitlines():
        dst = line.split()[0]
        if dst == "default":
            continue
        with contextlib.suppress(ValueError):
            if ipaddress.ip_network(dst, strict=False).overlaps(NETWORK):
                raise SitesError(
                    f"this machine already routes {dst} ({line.strip()}), which overlaps the testbed's "
                    f"{NETWORK}; remove that route first"
                )


def _ns_basics(netns: str) -> None:
    run(f"ip -n {netns} link set lo up")
    ipv6_off = "net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1"
    run(f"ip netns exec {netns} sysctl -q -w {ipv6_off}", check=False)


def make_router(wan: Network) -> None:
    """The router namespace, the launcher's link to it, and (for delay or loss) the relay's TUN devices."""
    r = ROUTER_NS
    run(f"ip netns add {r}")
    _ns_basics(r)
    run(f"ip netns exec {r} sysctl -q -w net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0")
    run(f"ip netns exec {r} sysctl -q -w net.ipv4.conf.default.rp_filter=0")
    # The launcher's link: root's msite0 <-> the router's to-l, never delayed.
    run(f"ip link add {IFACE} type veth peer name {LAUNCHER_DEV} netns {r}")
    run(f"sysctl -q -w net.ipv6.conf.{IFACE}.disable_ipv6=1", check=False)
    run(f"ip addr add {LAUNCHER_IP}/24 dev {IFACE}")
    run(f"ip link set {IFACE} up")
    run(f"ip -n {r} addr add 198.18.0.254/24 dev {LAUNCHER_DEV}")
    run(f"ip -n {r} link set {LAUNCHER_DEV} up")
    run(f"ip route add {NETWORK} via 198.18.0.254 dev {IFACE}")
    if wan.needs_relay:
        for dev in (TUN_IN, TUN_OUT):
            run(f"ip -n {r} tuntap add dev {dev} mode tun")
            run(f"ip -n {r} link set {dev} txqueuelen 5000 up")
        run(f"ip -n {r} route add {NETWORK} dev {TUN_IN} table {WAN_TABLE}")


def _tbf(netns: str, dev: str, wan: WanSpec, rtt_ms: float) -> None:
    """Shape ``dev``'s egress to the link's rate, its queue sized for the bandwidth-delay product of
    the longest round trip through it (``rtt_ms``)."""
    rate = wan.rate_bit
    assert rate is not None
    bytes_s = rate / 8
    rtt = rtt_ms / 1000
    burst = max(int(bytes_s * 0.004), 15140)  # 4 ms of data, at least 10 full frames
    limit = int(bytes_s * rtt) + 64 * 1514  # the bandwidth-delay product plus headroom
    run(f"tc -n {netns} qdisc add dev {dev} root tbf rate {rate}bit burst {burst} limit {limit}")


def make_site(site: Site, sites: Sequence[Site], wan: Network) -> None:
    """A site's namespace, its link to the router (shaped, policy-routed) and its /etc/hosts."""
    ns, r, dev = site.netns, ROUTER_NS, site.router_dev
    run(f"ip netns add {ns}")
    _ns_basics(ns)
    run(f"ip -n {ns} link add {IFACE} type veth peer name {dev} netns {r}")
    run(f"ip -n {ns} addr add {site.ip}/24 dev {IFACE}")
    run(f"ip -n {ns} link set {IFACE} up")
    run(f"ip -n {ns} route add {NETWORK} via {site.gateway} dev {IFACE}")
    run(f"ip -n {r} addr add {site.gateway}/24 dev {dev}")
    run(f"ip -n {r} link set {dev} up")
    if wan.needs_relay:
        prio = 1000 + 10 * site.index
        run(f"ip -n {r} rule add prio {prio} iif {dev} to 198.18.0.0/24 lookup main")  # to the launcher
        run(f"ip -n {r} rule add prio {prio + 1} iif {dev} lookup {WAN_TABLE}")  # to other sites
        # Never around the relay: if wan-in is gone, inter-site packets are dropped, not sent undelayed.
        run(f"ip -n {r} rule add prio {prio + 2} iif {dev} blackhole")
    link = wan.link(site.name)
    if link.rate_bit:
        rtt_ms = max([2 * wan.path(site.name, s.name).delay_ms for s in sites if s != site] or [0.0])
        _tbf(ns, IFACE, link, rtt_ms)
        _tbf(r, dev, link, rtt_ms)
    etc = Path("/etc/netns") / ns
    etc.mkdir(parents=True, exist_ok=True)
    # The names jobs use: the tunnel addresses in a secure testbed (Horovod's Gloo contexts take
    # their address from the hostname, so it must resolve to the address Gloo binds).
    launcher = LAUNCHER_TUNNEL_IP if site.secure else LAUNCHER_IP
    lines = ["127.0.0.1\tlocalhost", f"{launcher}\tmsite-launcher"]
    lines += [f"{s.job_ip}\t{s.hostname}" for s in sites]
    (etc / "hosts").write_text("\n".join(lines) + "\n")


def start_relay(wan: Network, sites: Sequence[Site], lifetime_s: float) -> subprocess.Popen:
    """Start the WAN relay (:mod:`medseg.distributed.testbed.relay`) in the router namespace, with
    each site's own link's delay and loss when the network has them; returns its process."""
    shared = wan.shared
    args = (
        f"--tun-in {TUN_IN} --tun-out {TUN_OUT} --delay-ms {shared.delay_ms} --loss {shared.loss} "
        f"--max-seconds {lifetime_s} --stats {RELAY_STATS}"
    )
    if wan.links:
        per_site = wan.per_site
        args += "".join(
            f" --link {s.index}={per_site[s.name].delay_ms}:{per_site[s.name].loss}" for s in sites
        )
    return start_daemon(in_netns(ROUTER_NS, sys.executable, str(RELAY), *args.split()), RELAY_LOG)


def wait_relay_attached(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Wait until the relay holds both TUN devices (each has a carrier); SitesError if it exits or stalls."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SitesError(f"the WAN relay exited at start ({proc.returncode}): see {RELAY_LOG}")
        links = run(["ip", "-n", ROUTER_NS, "-o", "link", "show"]).stdout
        if all(re.search(rf": {d}: <(?![^>]*NO-CARRIER)", links) for d in (TUN_IN, TUN_OUT)):
            return
        time.sleep(0.05)
    raise SitesError(f"the WAN relay did not attach to {TUN_IN}/{TUN_OUT} in {timeout:g} s: see {RELAY_LOG}")


# A socket keeps the namespace it was made in, so the probe can open sockets in two sites from one
# process: a short-lived thread enters the namespace (setns acts per thread) and makes the socket.
_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def call_in(netns: str, fn: Callable[[], T]) -> T:
    """``fn()`` run in a short-lived thread that has entered network namespace ``netns`` (setns acts
    per thread): every socket it makes belongs to that namespace; the rest of this process never
    changes namespace. Its exception is raised here (SitesError when the namespace cannot be entered)."""
    out: dict[str, object] = {}

    def work() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise SitesError(f"cannot enter namespace {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    t = threading.Thread(target=work, name=f"setns-{netns}")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]


def socket_in(netns: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket created inside network namespace ``netns`` (used from this process as any socket),
    made by :func:`call_in`."""
    try:
        return call_in(netns, lambda: socket.socket(socket.AF_INET, kind))
    except OSError as exc:
        raise SitesError(f"cannot open a socket in namespace {netns}: {exc}") from None
