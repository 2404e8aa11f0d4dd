"""An emulated hospital network on one machine: each site a real network host, joined by a shaped WAN.

``Testbed.up("a:2,b:2", wan="20mbit:25ms", cpu="a=0.5,b=0.25")`` (or ``medseg sites up``) makes, as
root, one Linux network namespace per hospital with its own address, hostname, sshd and CPU quota,
so that ``medseg train --np 4 --hosts <Testbed.hosts_arg()>`` launches its ranks through real ssh
and their Horovod traffic crosses a real (emulated) wide-area link, as it would across hospitals.

Topology (every address in 198.18.0.0/15, the range reserved for network benchmarks, RFC 2544)::

    root namespace (the launcher)           router namespace msite-router (ip_forward=1)
    msite0 198.18.0.1/24  <-- veth -->  to-l 198.18.0.254/24
                                        to-a 198.18.1.254/24  <-- veth -->  msite-a: msite0 198.18.1.1/24
                                        to-b 198.18.2.254/24  <-- veth -->  msite-b: msite0 198.18.2.1/24
                                        wan-in / wan-out: TUN devices of the relay

Why a router namespace and not a bridge: a bridge switches frames and cannot pick which of them
should pay the WAN delay. A router can, by policy routing: packets that arrive from a site's link
(``ip rule iif to-a ...``) and go to another site use a table whose only route is the relay's input
TUN device ``wan-in``; the relay (:mod:`medseg.distributed.testbed.relay`, since this kernel has no netem)
writes them out of ``wan-out`` after the one-way delay, dropping a fraction ``loss``, and from there
the main table forwards them to the destination site. Traffic between the launcher and a site
matches an earlier rule (``to 198.18.0.0/24 lookup main``) and never enters the relay. Only the
relay's devices carry inter-site traffic, so their counters are exactly the WAN bytes
(:meth:`Testbed.wan_counters`).

Bandwidth: a tbf qdisc on both ends of every site link (the site's ``msite0`` for its uplink, the
router's ``to-<site>`` for its downlink; tc shapes egress only), queue sized for the
bandwidth-delay product. Launcher-site traffic (ssh, rendezvous, heartbeats: little) shares that
link's rate but not its delay.

The launcher stays in the root namespace (:meth:`Testbed.launcher_prefix` is empty). Horovodrun
takes its rendezvous address from its own interface named first in ``--network-interfaces`` and
hands that same name to every rank as ``HOROVOD_GLOO_IFACE``; so the launcher's interface and every
site's interface share one name, ``msite0``, and ``--network-interfaces msite0`` is right on both
sides. Each site's hostname (``site-a``) resolves to its address inside every site (an
``/etc/netns/<ns>/hosts`` file that ``ip netns exec`` mounts over /etc/hosts), because Horovod's
Gloo process-set contexts take their address from ``gethostname()``. The ``-H`` names are the site
IPs (:meth:`Testbed.hosts_arg`): horovodrun resolves them in the root namespace, where the site
hostnames are not in /etc/hosts (the ssh config also knows ``site-a`` as an alias, for people).

Compute: one cgroup per site under cgroup v1 ``cpu`` (``/sys/fs/cgroup/cpu/medseg-sites/<site>``)
with quota = ranks x cores-per-rank and a high ``cpu.shares``; the site's sshd, hence every rank it
starts, lives in it.

Nothing here reaches the real network: sites route only 198.18.0.0/15, the router knows only its
connected /24s, and the root namespace does not forward. Every name we make starts with ``msite``
(``medseg-sites`` for the cgroup and ``/run/medseg-sites`` for keys, configs and the state file),
so ``down`` (and ``up`` after a crash) sweeps by prefix and also removes what a half-finished
``up`` left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from medseg.errors import MedsegError

log = logging.getLogger(__name__)

PREFIX = "msite-"  # network namespaces and /etc/netns folders
IFACE = "msite0"  # each site's interface and the launcher's, one name on purpose (see the docstring)
ROUTER_NS = "msite-router"
LAUNCHER_DEV = "to-l"
TUN_IN, TUN_OUT = "wan-in", "wan-out"
WAN_TABLE = 100
NETWORK = ipaddress.ip_network("198.18.0.0/15")
LAUNCHER_IP = "198.18.0.1"
STATE_DIR = Path("/run/medseg-sites")
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
CGROUP_NAME = "medseg-sites"
CFS_PERIOD_US = 20000  # 20 ms: a throttled rank waits at most a few ms, not the default 100 ms
CPU_SHARES = 8192  # 8x a normal task's weight, so other work on the machine disturbs the sites less
TOLERANCE = 0.10  # the probe's allowed relative error
RTT_FLOOR_MS = 0.5  # ... but never below this many ms (the probe's own cost at tiny delays)
TCP_GOODPUT = 1448 / 1514  # TCP payload per Ethernet frame (timestamps on): goodput vs tbf rate
SSHD = "/usr/sbin/sshd"
RELAY = Path(__file__).with_name("relay.py")
_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class SitesError(MedsegError):
    """The testbed cannot be made, used or checked; the message says what to install or undo."""


# --------------------------------------------------------------------------------------------
# Specs


@dataclass(frozen=True)
class WanSpec:
    """The inter-site link: rate in bit/s (None: not limited), one-way delay in ms, loss fraction."""

    rate_bit: int | None
    delay_ms: float
    loss: float

    @property
    def shaped(self) -> bool:
        return self.rate_bit is not None or self.delay_ms > 0 or self.loss > 0

    @property
    def needs_relay(self) -> bool:
        return self.delay_ms > 0 or self.loss > 0

    def __str__(self) -> str:
        if not self.shaped:
            return "none"
        rate = "none"
        if self.rate_bit:
            unit = next(u for u in ("gbit", "mbit", "kbit", "bit") if self.rate_bit % _RATE_UNITS[u] == 0)
            rate = f"{self.rate_bit // _RATE_UNITS[unit]}{unit}"
        return f"{rate}:{self.delay_ms:g}ms" + (f":{self.loss * 100:g}%" if self.loss else "")


_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}
_DELAY_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_wan(spec: str | WanSpec) -> WanSpec:
    """``RATE:DELAY[:LOSS]`` as tc writes them (``20mbit:25ms``, ``1gbit:5ms:0.1%``) or ``none``.

    RATE is in bit, kbit, mbit, gbit (bits per second) or bps, kbps, mbps, gbps (bytes per second,
    as in tc), or ``none`` for an unlimited rate with delay (``none:25ms``).
    """
    if isinstance(spec, WanSpec):
        return spec
    text = spec.strip().lower()
    if text == "none":
        return WanSpec(None, 0.0, 0.0)
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise SitesError(
            f"--wan {spec!r}: expected RATE:DELAY[:LOSS] (e.g. 20mbit:25ms or 20mbit:25ms:0.1%) or none"
        )
    rate: int | None = None
    if parts[0] != "none":
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", parts[0])
        if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
            raise SitesError(
                f"--wan {spec!r}: rate {parts[0]!r} is not a number with one of {sorted(_RATE_UNITS)}"
            )
        rate = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
        if rate < 8000:
            raise SitesError(f"--wan {spec!r}: rate below 8kbit is not a network tbf can emulate")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", parts[1])
    if not m:
        raise SitesError(f"--wan {spec!r}: delay {parts[1]!r} is not a number with us, ms or s (e.g. 25ms)")
    delay = float(m.group(1)) * _DELAY_UNITS[m.group(2)]
    if delay > 10_000:
        raise SitesError(f"--wan {spec!r}: a one-way delay over 10 s is not a WAN")
    loss = 0.0
    if len(parts) == 3:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)%", parts[2])
        if not m or float(m.group(1)) >= 100:
            raise SitesError(f"--wan {spec!r}: loss {parts[2]!r} is not a percentage below 100 (e.g. 0.1%)")
        loss = float(m.group(1)) / 100
    return WanSpec(rate, delay, loss)


def parse_sites(spec: str | dict[str, int] | Sequence[tuple[str, int]]) -> dict[str, int]:
    """``a:2,b:2`` (site name : ranks) -> ``{"a": 2, "b": 2}`` in order; names ``[a-z][a-z0-9]{0,11}``."""
    if isinstance(spec, str):
        items = []
        for item in spec.split(","):
            name, _, ranks = item.strip().partition(":")
            if not ranks.isdigit():
                raise SitesError(f"--sites: {item!r} is not NAME:RANKS (e.g. a:2,b:2)")
            items.append((name, int(ranks)))
    else:
        items = list(spec.items()) if isinstance(spec, dict) else list(spec)
    sites: dict[str, int] = {}
    for name, ranks in items:
        if not _NAME.match(name):
            raise SitesError(
                f"--sites: site name {name!r} must be a lowercase letter then up to 11 letters/digits"
            )
        if name in sites:
            raise SitesError(f"--sites: site {name!r} is named twice")
        if ranks < 1:
            raise SitesError(f"--sites: site {name!r} needs at least 1 rank")
        sites[name] = int(ranks)
    if not 1 <= len(sites) <= 200:
        raise SitesError("--sites: give between 1 and 200 sites (two or more for a WAN)")
    return sites


def parse_cpu(spec: str | dict[str, float] | None, sites: dict[str, int]) -> dict[str, float]:
    """``a=0.5,b=0.25`` (CPU cores per rank of that site) -> ``{"a": 0.5, "b": 0.25}``; sites left out are not capped."""
    if not spec:
        return {}
    if isinstance(spec, str):
        cpu = {}
        for item in spec.split(","):
            name, _, cores = item.strip().partition("=")
            try:
                cpu[name] = float(cores)
            except ValueError:
                raise SitesError(f"--cpu: {item!r} is not SITE=CORES (e.g. a=0.5,b=0.25)") from None
    else:
        cpu = {k: float(v) for k, v in spec.items()}
    for name, cores in cpu.items():
        if name not in sites:
            raise SitesError(f"--cpu: {name!r} is not one of the sites {', '.join(sites)}")
        if not 0.01 <= cores <= 1024:
            raise SitesError(f"--cpu: {name}={cores:g} cores per rank is out of range (0.01 to 1024)")
    return cpu


@dataclass(frozen=True)
class Site:
    """One emulated hospital: a namespace ``msite-<name>`` with address 198.18.<index>.1."""

    name: str
    index: int
    ranks: int
    cores_per_rank: float | None

    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def ip(self) -> str:
        return f"198.18.{self.index}.1"

    @property
    def gateway(self) -> str:
        return f"198.18.{self.index}.254"

    @property
    def hostname(self) -> str:
        return f"site-{self.name}"

    @property
    def router_dev(self) -> str:
        return f"to-{self.name}"

    @property
    def cgroup(self) -> Path:
        return CGROUP_ROOT / CGROUP_NAME / self.name

    @property
    def dir(self) -> Path:
        return STATE_DIR / "sites" / self.name


# --------------------------------------------------------------------------------------------
# Host checks and small helpers


def check_host(cpu: bool = False) -> None:
    """Raise SitesError unless this process can build a testbed: root, iproute2, util-linux, sshd, TUN."""
    if sys.platform != "linux":
        raise SitesError("the sites testbed needs Linux network namespaces")
    if os.geteuid() != 0:
        raise SitesError(
            "the sites testbed needs root (network namespaces, veths, tc, cgroups); run it as root"
        )
    missing = [t for t in ("ip", "tc", "unshare", "nsenter", "ssh", "ssh-keygen") if not shutil.which(t)]
    if not os.path.exists(SSHD):
        missing.append(SSHD)
    if missing:
        raise SitesError(
            f"the sites testbed needs {', '.join(missing)}: run `make sites-deps` "
            "(apt-get install openssh-server openssh-client iproute2 util-linux)"
        )
    if not os.path.exists("/dev/net/tun"):
        raise SitesError("/dev/net/tun is missing: the WAN relay needs TUN devices")
    if cpu and not (CGROUP_ROOT / "cpu.cfs_quota_us").exists():
        raise SitesError(f"--cpu needs cgroup v1 cpu mounted at {CGROUP_ROOT} (cpu.cfs_quota_us not found)")


def _run(argv: str | Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a command (a string is split on spaces: only for our own names and numbers); SitesError on failure."""
    argv = argv.split() if isinstance(argv, str) else list(argv)
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SitesError(f"`{' '.join(argv)}` did not finish in {timeout:g} s") from None
    if check and proc.returncode != 0:
        raise SitesError(
            f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def _ns(netns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv]


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def _our_namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.startswith(PREFIX)]


def _netns_pids(netns: str) -> set[int]:
    proc = _run(["ip", "netns", "pids", netns], check=False)
    return {int(p) for p in proc.stdout.split() if p.isdigit()}


def _cgroup_pids() -> set[int]:
    pids: set[int] = set()
    base = CGROUP_ROOT / CGROUP_NAME
    if base.is_dir():
        for procs in base.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in procs.read_text().split()}
    return pids


def _kill_all(pids: set[int], grace: float = 5.0) -> None:
    pids -= {os.getpid(), os.getppid(), 0, 1}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.05)
        # Reap our own children (the relay and sshds were started by this process when it ran `up`).
        for pid in pids:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        pids = {p for p in pids if _alive(p)}
        if not pids:
            return
    if pids:
        log.warning("sites: processes %s did not exit after SIGKILL", sorted(pids))


@contextlib.contextmanager
def _lock(timeout: float = 120.0) -> Iterator[None]:
    """Serialise every up/down on this machine (two testbeds would fight over names and routes)."""
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / "lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        end = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise SitesError(
                        f"another process holds {STATE_DIR / 'lock'} (a testbed going up or down) for over {timeout:g} s"
                    ) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def sweep() -> list[str]:
    """Remove everything a testbed (finished, crashed or half made) left: returns what was removed.

    Processes in our namespaces or cgroups (sshd, ranks, relay) are ended first (SIGTERM, then
    SIGKILL), then the namespaces (which takes their veths and TUN devices with them), the root
    ``msite0`` link, ``/etc/netns/msite-*``, the cgroups and the state files.
    """
    removed: list[str] = []
    namespaces = _our_namespaces()
    pids = _cgroup_pids()
    for netns in namespaces:
        pids |= _netns_pids(netns)
    state = _read_state()
    if state:
        relay = state.get("pids", {}).get("relay")
        if relay and _alive(relay) and "relay" in _cmdline(relay):
            pids.add(relay)
    if pids:
        _kill_all(pids)
        removed.append(f"processes {sorted(pids)}")
    for netns in namespaces:
        _run(["ip", "netns", "del", netns], check=False)
        removed.append(f"netns {netns}")
    if _run(["ip", "link", "show", IFACE], check=False).returncode == 0:
        _run(["ip", "link", "del", IFACE], check=False)
        removed.append(f"link {IFACE}")
    etc = Path("/etc/netns")
    if etc.is_dir():
        for d in etc.glob(f"{PREFIX}*"):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
        with contextlib.suppress(OSError):
            etc.rmdir()  # only when empty: someone else's entries stay
    base = CGROUP_ROOT / CGROUP_NAME
    if base.is_dir():
        for attempt in range(50):  # killed tasks leave their cgroup asynchronously
            try:
                for d in sorted((p for p in base.iterdir() if p.is_dir()), reverse=True):
                    if d.is_dir():
                        d.rmdir()
                base.rmdir()
                break
            except OSError as exc:
                if attempt == 49:
                    log.warning("sites: could not remove cgroup %s: %s", base, exc)
                time.sleep(0.1)
        removed.append(f"cgroup {base}")
    if STATE_DIR.is_dir():
        for p in STATE_DIR.iterdir():
            if p.name != "lock":
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    if state and state.get("made_run_sshd"):
        with contextlib.suppress(OSError):
            Path("/run/sshd").rmdir()
    return removed


def down() -> list[str]:
    """Remove the testbed on this machine, whoever made it, and whatever a crash left (see :func:`sweep`)."""
    with _lock():
        return sweep()


def leftovers() -> list[str]:
    """What of a testbed still exists on this machine (empty after a clean ``down``): for tests."""
    found = [f"netns {n}" for n in _our_namespaces()]
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    found += [f"link {m}" for m in re.findall(r"^\d+: (msite[^:@ ]*)", links, flags=re.M)]
    if (CGROUP_ROOT / CGROUP_NAME).exists():
        found.append(f"cgroup {CGROUP_ROOT / CGROUP_NAME}")
    if Path("/etc/netns").is_dir():
        found += [str(d) for d in Path("/etc/netns").glob(f"{PREFIX}*")]
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            cmd = _cmdline(int(pid_dir.name))
            if str(STATE_DIR) in cmd or str(RELAY) in cmd:
                found.append(f"process {pid_dir.name}: {cmd[:100]}")
    if (STATE_DIR / "state.json").exists():
        found.append(str(STATE_DIR / "state.json"))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _read_state() -> dict | None:
    path = STATE_DIR / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Sockets inside a namespace (for the probe): a socket keeps the namespace it was made in.

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def socket_in(netns: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket created inside network namespace ``netns`` (used from this process as any socket).

    A short-lived thread enters the namespace (setns acts per thread) and creates the socket there;
    the rest of this process never changes namespace.
    """
    out: dict[str, object] = {}

    def work() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({netns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            out["sock"] = socket.socket(socket.AF_INET, kind)
        except Exception as exc:  # handed to the caller
            out["error"] = exc

    t = threading.Thread(target=work, name=f"setns-{netns}")
    t.start()
    t.join()
    if "error" in out:
        raise SitesError(f"cannot open a socket in namespace {netns}: {out['error']}")
    return out["sock"]  # type: ignore[return-value]


@contextlib.contextmanager
def _realtime_thread(priority: int = 10) -> Iterator[None]:
    """Run the calling thread SCHED_FIFO for the block (root only; otherwise unchanged).

    The RTT probe times 1-byte exchanges between two threads of this process; on a loaded machine
    every wake-up of a normal thread waits for a time slice, which adds milliseconds to each RTT
    that the link does not have (measured: 68 ms for a 50 ms link at load average 22).
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


def tcp_rtt_ms(src: Site, dst: Site, count: int = 30, timeout: float = 5.0) -> list[float]:
    """Round-trip times (ms) of ``count`` 1-byte TCP request/responses (TCP_NODELAY) from src to dst.

    Both ends run real-time (:func:`_realtime_thread`), like the relay, so that the figure is the
    link's and not the scheduler's."""
    server = socket_in(dst.netns)
    client = socket_in(src.netns)
    try:
        server.bind((dst.ip, 0))
        server.listen(1)
        server.settimeout(timeout)
        port = server.getsockname()[1]
        errors: list[BaseException] = []

        def echo() -> None:
            try:
                with _realtime_thread():
                    _echo()
            except OSError as exc:
                errors.append(exc)

        def _echo() -> None:
            c, _ = server.accept()
            with c:
                c.settimeout(timeout)
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(count + 1):
                    if not c.recv(1):
                        return
                    c.sendall(b"y")

        th = threading.Thread(target=echo, daemon=True)
        th.start()
        client.settimeout(timeout)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            client.connect((dst.ip, port))
            rtts = []
            with _realtime_thread():
                for i in range(count + 1):
                    t0 = time.perf_counter()
                    client.sendall(b"x")
                    if not client.recv(1):
                        raise SitesError(f"probe: {dst.hostname} closed the connection")
                    if i:  # the first exchange also pays the connection's set-up on the server side
                        rtts.append((time.perf_counter() - t0) * 1000)
        except OSError as exc:
            raise SitesError(
                f"probe: no TCP exchange from {src.hostname} to {dst.hostname} ({dst.ip}): {exc}"
            ) from None
        th.join(timeout)
        return rtts
    finally:
        client.close()
        server.close()


def tcp_throughput(
    src: Site,
    dst: Site,
    seconds: float = 3.0,
    warmup: float = 0.5,
    max_bytes: int = 1 << 30,
    timeout: float = 10.0,
) -> dict[str, float]:
    """One TCP flow src -> dst for ``seconds`` (or ``max_bytes``); rate measured at the receiver.

    The receiver's clock runs from ``warmup`` seconds after the first byte (slow start excluded), or
    from the first quarter of ``max_bytes`` when that comes sooner (an unshaped link can carry all of
    ``max_bytes`` within the warm-up), to the last byte; returns ``mbit_s``, ``bytes`` (all received) and ``seconds`` (the measured span).
    """
    server = socket_in(dst.netns)
    client = socket_in(src.netns)
    result: dict[str, float] = {}
    try:
        server.bind((dst.ip, 0))
        server.listen(1)
        server.settimeout(timeout)
        port = server.getsockname()[1]
        errors: list[BaseException] = []

        def receive() -> None:
            try:
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
            except OSError as exc:
                errors.append(exc)

        th = threading.Thread(target=receive, daemon=True)
        th.start()
        client.settimeout(timeout)
        chunk = b"\0" * (1 << 16)
        sent = 0
        try:
            client.connect((dst.ip, port))
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


def tcp_connect_error(src: Site, dst: Site, timeout: float = 2.0) -> OSError | None:
    """None when a TCP connection from src to dst's address is set up within ``timeout`` seconds, else
    why not (a timeout or "unreachable" for a cut link; a refusal would mean dst was reached)."""
    server = socket_in(dst.netns)
    client = socket_in(src.netns)
    try:
        server.bind((dst.ip, 0))
        server.listen(1)
        client.settimeout(timeout)
        try:
            client.connect((dst.ip, server.getsockname()[1]))
        except OSError as exc:
            return exc
        return None
    finally:
        client.close()
        server.close()


def tcp_connects(src: Site, dst: Site, timeout: float = 2.0) -> bool:
    """True when a TCP connection from src to dst's address is set up within ``timeout`` seconds."""
    return tcp_connect_error(src, dst, timeout) is None


# --------------------------------------------------------------------------------------------
# The testbed


class Testbed:
    """A running emulated hospital network; made by :meth:`up`, found again by :meth:`current`.

    The state lives in ``/run/medseg-sites/state.json``, so a CLI ``medseg sites up`` in one
    process and ``Testbed.current().probe()`` in another see the same testbed.
    """

    def __init__(self, state: dict) -> None:
        self.state = state
        self.sites = [Site(**s) for s in state["sites"]]
        self.wan = WanSpec(**state["wan"])

    # ---- making and removing ------------------------------------------------------------

    @classmethod
    def up(
        cls,
        sites: str | dict[str, int],
        wan: str | WanSpec = "none",
        cpu: str | dict[str, float] | None = None,
        *,
        probe: bool = True,
        lifetime_s: float = 4 * 3600,
        owned: bool = True,
    ) -> Testbed:
        """Build the testbed (cleaning up a crashed one first); with ``probe``, check its shaping.

        ``owned``: the testbed belongs to this process; another ``up`` refuses to replace it while
        this process lives (the CLI's ``medseg sites up`` passes False: its testbed outlives it and
        the next ``up`` replaces it). ``lifetime_s`` bounds the relay (the WAN stops after it).
        Any failure, the probe's included, removes everything made so far and raises SitesError.
        """
        names = parse_sites(sites)
        wan_spec = parse_wan(wan)
        cores = parse_cpu(cpu, names)
        check_host(cpu=bool(cores))
        site_list = [Site(n, i + 1, r, cores.get(n)) for i, (n, r) in enumerate(names.items())]
        quota = sum(s.ranks * s.cores_per_rank for s in site_list if s.cores_per_rank)
        ncpu = os.cpu_count() or 1
        if quota and quota >= ncpu:
            log.warning(
                "sites: the CPU quotas add up to %.2f cores but this machine has %d: the sites will compete "
                "for real cores and the emulated speed ratios will not hold",
                quota,
                ncpu,
            )
        state = {
            "version": 1,
            "status": "coming-up",
            "owner_pid": os.getpid() if owned else None,
            "created": time.time(),
            "sites": [asdict(s) for s in site_list],
            "wan": asdict(wan_spec),
            "lifetime_s": lifetime_s,
            "pids": {"sshd": {}},
        }
        with _lock():
            old = _read_state()
            if old and old.get("owner_pid") and old["owner_pid"] != os.getpid() and _alive(old["owner_pid"]):
                raise SitesError(
                    f"a testbed of process {old['owner_pid']} is up ({', '.join(s['name'] for s in old['sites'])}); "
                    "wait for it to end, or end that process and run `medseg sites down`"
                )
            gone = sweep()
            if gone:
                log.warning("sites: removed a previous testbed's leftovers: %s", "; ".join(gone))
            tb = cls(state)
            try:
                tb._build()
            except BaseException:
                log.error("sites: up failed; removing what was made")
                sweep()
                raise
        if probe:
            try:
                tb.probe(check=True)
            except BaseException:
                tb.down()
                raise
        return tb

    @classmethod
    def current(cls) -> Testbed:
        """The testbed that is up on this machine (from its state file), or SitesError."""
        state = _read_state()
        if not state or state.get("status") != "up":
            raise SitesError(
                "no testbed is up: start one with `medseg sites up --sites a:2,b:2 --wan 20mbit:25ms`"
            )
        return cls(state)

    def down(self) -> list[str]:
        """Remove every namespace, veth, cgroup, process and file of the testbed; returns what went."""
        with _lock():
            state = _read_state()
            if state and state.get("created") != self.state.get("created"):
                log.warning("sites: the testbed on this machine is not this one any more; removing it anyway")
            removed = sweep()
        log.info("sites: down (%d kinds of things removed)", len(removed))
        return removed

    def _save(self) -> None:
        tmp = STATE_DIR / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, STATE_DIR / "state.json")

    def _build(self) -> None:
        t0 = time.monotonic()
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._save()
        self._check_routes()
        self._make_router()
        for site in self.sites:
            self._make_site(site)
        if self.wan.needs_relay:
            self._start_relay()
        self._make_cgroups()
        self._make_ssh()
        for site in self.sites:
            self._start_sshd(site)
        for site in self.sites:
            self._wait_sshd(site)
        self.state["status"] = "up"
        self._save()
        log.info(
            "sites: up in %.1f s: %s; WAN %s",
            time.monotonic() - t0,
            ", ".join(f"{s.hostname} {s.ip} x{s.ranks}" for s in self.sites),
            self.wan,
        )

    def _check_routes(self) -> None:
        """Refuse when the root namespace already routes part of 198.18.0.0/15 (not ours)."""
        for line in _run(["ip", "-4", "route", "show"]).stdout.splitlines():
            dst = line.split()[0]
            if dst == "default":
                continue
            with contextlib.suppress(ValueError):
                if ipaddress.ip_network(dst, strict=False).overlaps(NETWORK):
                    raise SitesError(
                        f"this machine already routes {dst} ({line.strip()}), which overlaps the testbed's "
                        f"{NETWORK}; remove that route first"
                    )

    def _make_router(self) -> None:
        r = ROUTER_NS
        _run(f"ip netns add {r}")
        self._ns_basics(r)
        _run(f"ip netns exec {r} sysctl -q -w net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0")
        _run(f"ip netns exec {r} sysctl -q -w net.ipv4.conf.default.rp_filter=0")
        # The launcher's link: root's msite0 <-> the router's to-l, never delayed.
        _run(f"ip link add {IFACE} type veth peer name {LAUNCHER_DEV} netns {r}")
        _run(f"sysctl -q -w net.ipv6.conf.{IFACE}.disable_ipv6=1", check=False)
        _run(f"ip addr add {LAUNCHER_IP}/24 dev {IFACE}")
        _run(f"ip link set {IFACE} up")
        _run(f"ip -n {r} addr add 198.18.0.254/24 dev {LAUNCHER_DEV}")
        _run(f"ip -n {r} link set {LAUNCHER_DEV} up")
        _run(f"ip route add {NETWORK} via 198.18.0.254 dev {IFACE}")
        if self.wan.needs_relay:
            for dev in (TUN_IN, TUN_OUT):
                _run(f"ip -n {r} tuntap add dev {dev} mode tun")
                _run(f"ip -n {r} link set {dev} txqueuelen 5000 up")
            _run(f"ip -n {r} route add {NETWORK} dev {TUN_IN} table {WAN_TABLE}")

    @staticmethod
    def _ns_basics(netns: str) -> None:
        _run(f"ip -n {netns} link set lo up")
        ipv6_off = "net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1"
        _run(f"ip netns exec {netns} sysctl -q -w {ipv6_off}", check=False)

    def _tbf(self, netns: str, dev: str) -> None:
        rate = self.wan.rate_bit
        assert rate is not None
        bytes_s = rate / 8
        rtt = 2 * self.wan.delay_ms / 1000
        burst = max(int(bytes_s * 0.004), 15140)  # 4 ms of data, at least 10 full frames
        limit = int(bytes_s * rtt) + 64 * 1514  # the bandwidth-delay product plus headroom
        _run(f"tc -n {netns} qdisc add dev {dev} root tbf rate {rate}bit burst {burst} limit {limit}")

    def _make_site(self, site: Site) -> None:
        ns, r, dev = site.netns, ROUTER_NS, site.router_dev
        _run(f"ip netns add {ns}")
        self._ns_basics(ns)
        _run(f"ip -n {ns} link add {IFACE} type veth peer name {dev} netns {r}")
        _run(f"ip -n {ns} addr add {site.ip}/24 dev {IFACE}")
        _run(f"ip -n {ns} link set {IFACE} up")
        _run(f"ip -n {ns} route add {NETWORK} via {site.gateway} dev {IFACE}")
        _run(f"ip -n {r} addr add {site.gateway}/24 dev {dev}")
        _run(f"ip -n {r} link set {dev} up")
        if self.wan.needs_relay:
            prio = 1000 + 10 * site.index
            _run(f"ip -n {r} rule add prio {prio} iif {dev} to 198.18.0.0/24 lookup main")  # to the launcher
            _run(f"ip -n {r} rule add prio {prio + 1} iif {dev} lookup {WAN_TABLE}")  # to other sites
            # Never around the relay: if wan-in is gone, inter-site packets are dropped, not sent undelayed.
            _run(f"ip -n {r} rule add prio {prio + 2} iif {dev} blackhole")
        if self.wan.rate_bit:
            self._tbf(ns, IFACE)
            self._tbf(r, dev)
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1\tlocalhost", f"{LAUNCHER_IP}\tmsite-launcher"]
        lines += [f"{s.ip}\t{s.hostname}" for s in self.sites]
        (etc / "hosts").write_text("\n".join(lines) + "\n")

    def _start_relay(self) -> None:
        log_path = STATE_DIR / "relay.log"
        args = (
            f"--tun-in {TUN_IN} --tun-out {TUN_OUT} --delay-ms {self.wan.delay_ms} --loss {self.wan.loss} "
            f"--max-seconds {self.state['lifetime_s']} --stats {STATE_DIR / 'relay-stats.json'}"
        )
        argv = _ns(ROUTER_NS, sys.executable, str(RELAY), *args.split())
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.state["pids"]["relay"] = proc.pid
        self._save()
        end = time.monotonic() + 10
        while time.monotonic() < end:  # attached when both TUN devices have a carrier
            if proc.poll() is not None:
                raise SitesError(f"the WAN relay exited at start ({proc.returncode}): see {log_path}")
            links = _run(["ip", "-n", ROUTER_NS, "-o", "link", "show"]).stdout
            if all(re.search(rf": {d}: <(?![^>]*NO-CARRIER)", links) for d in (TUN_IN, TUN_OUT)):
                return
            time.sleep(0.05)
        raise SitesError(f"the WAN relay did not attach to {TUN_IN}/{TUN_OUT} in 10 s: see {log_path}")

    def _make_cgroups(self) -> None:
        if not (CGROUP_ROOT / "cpu.shares").exists():
            if any(s.cores_per_rank for s in self.sites):
                raise SitesError(f"--cpu needs cgroup v1 cpu at {CGROUP_ROOT}")
            log.warning("sites: no cgroup v1 cpu at %s; sites run without CPU cgroups", CGROUP_ROOT)
            return
        base = CGROUP_ROOT / CGROUP_NAME
        base.mkdir(exist_ok=True)
        (base / "cpu.shares").write_text(str(CPU_SHARES))
        for site in self.sites:
            site.cgroup.mkdir(exist_ok=True)
            (site.cgroup / "cpu.shares").write_text(str(CPU_SHARES))
            (site.cgroup / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            quota = -1
            if site.cores_per_rank:
                quota = max(1000, int(site.ranks * site.cores_per_rank * CFS_PERIOD_US))
            (site.cgroup / "cpu.cfs_quota_us").write_text(str(quota))

    @property
    def ssh_config(self) -> Path:
        return STATE_DIR / "ssh_config"

    @property
    def bin_dir(self) -> Path:
        """Put first on PATH: its ``ssh`` uses the testbed's key and config (horovodrun calls plain ssh)."""
        return STATE_DIR / "bin"

    def _make_ssh(self) -> None:
        key = STATE_DIR / "id_ed25519"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "medseg-sites", "-f", str(key)])
        (STATE_DIR / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
        hosts = " ".join(s.ip for s in self.sites)
        aliases = "".join(f"Host {s.hostname}\n    HostName {s.ip}\n" for s in self.sites)
        self.ssh_config.write_text(
            aliases
            + f"Host {hosts} {' '.join(s.hostname for s in self.sites)}\n"
            + "    User root\n"
            + f"    IdentityFile {key}\n"
            + "    IdentitiesOnly yes\n"
            + "    BatchMode yes\n"
            + "    StrictHostKeyChecking no\n"
            + "    UserKnownHostsFile /dev/null\n"
            + "    GlobalKnownHostsFile /dev/null\n"
            + "    LogLevel ERROR\n"
            + "    ConnectTimeout 10\n"
            + "    ServerAliveInterval 15\n"
        )
        self.bin_dir.mkdir(exist_ok=True)
        wrapper = self.bin_dir / "ssh"
        wrapper.write_text(
            f'#!/bin/sh\n# medseg sites: the testbed\'s ssh (key, config)\nexec /usr/bin/ssh -F {self.ssh_config} "$@"\n'
        )
        wrapper.chmod(0o755)
        if not Path("/run/sshd").exists():  # sshd's privilege-separation folder
            Path("/run/sshd").mkdir(mode=0o755)
            self.state["made_run_sshd"] = True
            self._save()

    def _start_sshd(self, site: Site) -> None:
        site.dir.mkdir(parents=True, exist_ok=True)
        host_key = site.dir / "ssh_host_ed25519_key"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", site.hostname, "-f", str(host_key)])
        cfg = site.dir / "sshd_config"
        cfg.write_text(
            f"ListenAddress {site.ip}\n"
            "Port 22\n"
            f"HostKey {host_key}\n"
            f"PidFile {site.dir / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {STATE_DIR / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "UseDNS no\n"
            "X11Forwarding no\n"
            "AllowTcpForwarding no\n"
            "PrintMotd no\n"
            "PrintLastLog no\n"
            "MaxStartups 64:30:128\n"
            "MaxSessions 64\n"
        )
        # Join the site's cgroup before entering the namespace: `ip netns exec` remounts /sys, and
        # the cgroup tree is not under the new mount. Every exec below keeps this one process id.
        join = f"echo $$ > {site.cgroup}/cgroup.procs && " if site.cgroup.is_dir() else ""
        inner = f"hostname {site.hostname} && exec {SSHD} -D -e -f {cfg}"
        argv = [
            "sh",
            "-c",
            f'{join}exec "$@"',
            "sh",
            *_ns(site.netns, "unshare", "--uts", "--", "sh", "-c", inner),
        ]
        with open(site.dir / "sshd.log", "ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.state["pids"]["sshd"][site.name] = proc.pid
        self._save()

    def _wait_sshd(self, site: Site, timeout: float = 20.0) -> None:
        """Wait until ``ssh <site ip> hostname`` answers with the site's hostname."""
        end = time.monotonic() + timeout
        last = ""
        while time.monotonic() < end:
            pid = self.state["pids"]["sshd"][site.name]
            if not _alive(pid):
                raise SitesError(f"sshd of {site.hostname} exited: see {site.dir / 'sshd.log'}")
            proc = subprocess.run(
                [str(self.bin_dir / "ssh"), "-o", "ConnectTimeout=2", site.ip, "hostname"],
                capture_output=True,
                text=True,
                timeout=15,
            )
            if proc.returncode == 0 and proc.stdout.strip() == site.hostname:
                return
            last = (proc.stderr or proc.stdout).strip()
            time.sleep(0.2)
        raise SitesError(f"sshd of {site.hostname} ({site.ip}) did not answer in {timeout:g} s: {last}")

    # ---- using ----------------------------------------------------------------------------

    def site(self, name: str) -> Site:
        for s in self.sites:
            if s.name == name:
                return s
        raise SitesError(f"no site {name!r} in this testbed (sites: {', '.join(s.name for s in self.sites)})")

    def site_ip(self, name: str) -> str:
        return self.site(name).ip

    def hosts_arg(self) -> str:
        """The ``--hosts`` value: ``198.18.1.1:2,198.18.2.1:2`` (site IPs, resolvable in the launcher)."""
        return ",".join(f"{s.ip}:{s.ranks}" for s in self.sites)

    def launcher_prefix(self) -> list[str]:
        """argv prefix for the launcher: empty, since the launcher runs in the root namespace."""
        return []

    def launcher_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for ``medseg train --np N --hosts <hosts_arg()>`` from the launcher position.

        The testbed's ``ssh`` first on PATH, then the running Python's bin folder (horovodrun);
        ``MEDSEG_HOROVODRUN_ARGS`` names the common interface (horovodrun takes its rendezvous
        address from it and gives its name to the ranks as ``HOROVOD_GLOO_IFACE``) and skips
        horovodrun's cache of interface checks; ``MEDSEG_BEAT_HOST`` is the launcher's address.
        """
        env = dict(os.environ if base is None else base)
        env["PATH"] = os.pathsep.join(
            [str(self.bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]
        )
        env["MEDSEG_HOROVODRUN_ARGS"] = f"--network-interfaces {IFACE} --disable-cache"
        env["MEDSEG_BEAT_HOST"] = LAUNCHER_IP
        env["HOROVOD_GLOO_IFACE"] = IFACE
        return env

    def site_prefix(self, name: str) -> list[str]:
        """argv prefix that runs a command as a rank of that site would run: its network, hostname,
        /etc/hosts and CPU cgroup (entered through the namespaces of the site's sshd)."""
        site = self.site(name)
        pid = self.state["pids"]["sshd"].get(site.name)
        if not _alive(pid):
            raise SitesError(f"sshd of {site.hostname} is not running; bring the testbed up again")
        join = f"echo $$ > {site.cgroup}/cgroup.procs; " if site.cgroup.is_dir() else ""
        nsenter = ["nsenter", f"--target={pid}", "--net", "--uts", "--mount", "--"]
        return ["sh", "-c", f'{join}exec "$@"', "sh", *nsenter]

    def exec_in(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside a site (see :meth:`site_prefix`); kwargs go to ``subprocess.run``."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 600)
        return subprocess.run(self.site_prefix(name) + list(argv), **kwargs)

    def cut(self, name: str) -> None:
        """Take a site's link down at the router: it loses the WAN (and the launcher) until :meth:`restore`."""
        _run(["ip", "-n", ROUTER_NS, "link", "set", self.site(name).router_dev, "down"])
        log.info("sites: cut %s", name)

    def restore(self, name: str) -> None:
        """Bring a cut site link back up."""
        _run(["ip", "-n", ROUTER_NS, "link", "set", self.site(name).router_dev, "up"])
        log.info("sites: restored %s", name)

    def _link_stats(self, netns: str) -> dict[str, dict]:
        proc = _run(["ip", "-n", netns, "-s", "-j", "link", "show"])
        return {d["ifname"]: d for d in json.loads(proc.stdout)}

    def wan_counters(self) -> dict:
        """Bytes and packets that crossed between sites, counted at the WAN boundary.

        With a relay (any delay or loss): the kernel's counters of the relay's TUN devices in the
        router namespace, which carry inter-site packets only (launcher traffic never enters them):
        ``bytes``/``packets`` are IP packets (headers included, no Ethernet header) the sites sent
        into the WAN, ``delivered_*`` those that came out (after loss). ``links`` gives per site
        the bytes and packets it sent and received over the WAN, and ``tcp`` what the relay saw
        inside them (exact header and payload bytes, retransmitted payload: ``relay.Counters``), from
        the relay's own counters (updated every 0.5 s). Without a relay (``--wan none`` or rate only): the router's veth
        counters, sites' received minus what went to the launcher, Ethernet headers removed
        (ARP and the like make this approximate); ``source`` says which.
        The relay's counters are waited for (up to 2 s) until it has written them after this call
        began: a stale file would move the end of an earlier transfer (the probe's) into the next
        measurement (0.3 MB measured once).
        """
        if self.wan.needs_relay:
            called, deadline = time.time(), time.monotonic() + 2.0
            while time.monotonic() < deadline:
                try:
                    if json.loads((STATE_DIR / "relay-stats.json").read_text()).get("time", 0) >= called:
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(0.05)
        stats = self._link_stats(ROUTER_NS)
        if self.wan.needs_relay:
            tin, tout = stats[TUN_IN]["stats64"], stats[TUN_OUT]["stats64"]
            out = {
                "source": "relay TUN devices (router namespace)",
                "bytes": tin["tx"]["bytes"],
                "packets": tin["tx"]["packets"],
                "delivered_bytes": tout["rx"]["bytes"],
                "delivered_packets": tout["rx"]["packets"],
            }
            links = {
                s.name: {"sent_bytes": 0, "sent_packets": 0, "received_bytes": 0, "received_packets": 0}
                for s in self.sites
            }
            by_index = {s.index: s.name for s in self.sites}
            try:
                relay_stats = json.loads((STATE_DIR / "relay-stats.json").read_text())
                pairs = relay_stats["pairs"]
            except (OSError, ValueError, KeyError):
                relay_stats, pairs = {}, {}
            if "tcp" in relay_stats:  # what the relay saw inside the packets (headers, retransmissions)
                out["tcp"] = relay_stats["tcp"]
            for key, v in pairs.items():
                src, dst = (int(x) for x in key.split(">"))
                if src in by_index:
                    links[by_index[src]]["sent_bytes"] += v["bytes"]
                    links[by_index[src]]["sent_packets"] += v["packets"]
                if dst in by_index:
                    links[by_index[dst]]["received_bytes"] += v["bytes"]
                    links[by_index[dst]]["received_packets"] += v["packets"]
            out["links"] = links
            return out
        rx = sum(stats[s.router_dev]["stats64"]["rx"]["bytes"] for s in self.sites)
        rxp = sum(stats[s.router_dev]["stats64"]["rx"]["packets"] for s in self.sites)
        to_l = stats[LAUNCHER_DEV]["stats64"]["tx"]
        packets = rxp - to_l["packets"]
        return {
            "source": "router veths minus launcher traffic (approximate)",
            "bytes": rx - to_l["bytes"] - 14 * packets,
            "packets": packets,
            "delivered_bytes": None,
            "delivered_packets": None,
            "links": {
                s.name: {
                    "sent_bytes": stats[s.router_dev]["stats64"]["rx"]["bytes"],
                    "sent_packets": stats[s.router_dev]["stats64"]["rx"]["packets"],
                    "received_bytes": stats[s.router_dev]["stats64"]["tx"]["bytes"],
                    "received_packets": stats[s.router_dev]["stats64"]["tx"]["packets"],
                }
                for s in self.sites
            },
        }

    def status(self) -> dict:
        """What is up: sites (address, hostname, ranks, CPU quota, sshd), the WAN and the relay."""
        stats = self._link_stats(ROUTER_NS) if ROUTER_NS in _our_namespaces() else {}
        sites = []
        for s in self.sites:
            quota = None
            with contextlib.suppress(OSError):
                q = int((s.cgroup / "cpu.cfs_quota_us").read_text())
                quota = None if q < 0 else q / int((s.cgroup / "cpu.cfs_period_us").read_text())
            dev = stats.get(s.router_dev, {})
            sites.append(
                {
                    "name": s.name,
                    "hostname": s.hostname,
                    "ip": s.ip,
                    "netns": s.netns,
                    "ranks": s.ranks,
                    "cores_per_rank": s.cores_per_rank,
                    "cpu_quota_cores": quota,
                    "sshd_alive": _alive(self.state["pids"]["sshd"].get(s.name)),
                    "link_up": "UP" in dev.get("flags", []),
                }
            )
        relay = self.state["pids"].get("relay")
        return {
            "status": self.state.get("status"),
            "owner_pid": self.state.get("owner_pid"),
            "wan": str(self.wan),
            "relay_alive": _alive(relay) if relay else None,
            "launcher_ip": LAUNCHER_IP,
            "hosts": self.hosts_arg(),
            "sites": sites,
        }

    def _rate_ok(self, mbit_s: float) -> bool:
        """Whether a measured throughput is within the tolerance of the WAN's rate."""
        exp = self.wan.rate_bit / 1e6
        return abs(mbit_s - exp) <= TOLERANCE * exp

    def probe(
        self, src: str | None = None, dst: str | None = None, check: bool = True, seconds: float = 3.0
    ) -> dict:
        """Measure RTT and throughput between two sites (default the first two) against the spec.

        RTT: median of 30 one-byte TCP request/responses (TCP_NODELAY); expected 2 x one-way
        delay. Throughput: one TCP flow for ``seconds`` (slow start's first 0.5 s not counted),
        timed at the receiver, and a second flow when the first is off (the better one counts: a
        congestion event inside 3 s can cost a few per cent); expected the tbf rate. TCP's payload is 1448 of every 1514 bytes
        on the wire, so goodput runs about 4.4 % under the rate: within the 10 % allowance. With
        loss, what TCP achieves depends on its congestion control (CUBIC kept 19.2 of 20 Mbit/s at
        0.5 % loss and 50 ms here; Reno would get far less), so then only "not above the rate" is
        checked. ``ok`` is False when a checked value is more than 10 %
        off (0.5 ms at least for RTT); with ``check`` that raises SitesError.
        """
        if len(self.sites) < 2:
            raise SitesError("probe: the testbed has one site; the WAN needs two")
        a = self.site(src) if src else self.sites[0]
        b = self.site(dst) if dst else self.sites[1]
        rtts = tcp_rtt_ms(a, b)
        flows = [tcp_throughput(a, b, seconds=seconds)]
        if self.wan.rate_bit and not self.wan.loss and not self._rate_ok(flows[0]["mbit_s"]):
            # one congestion event in a 3 s flow can cost a few per cent: the link's rate is the
            # better of two flows (both reported), and a shaping that is really off fails both
            flows.append(tcp_throughput(a, b, seconds=seconds))
        flow = max(flows, key=lambda f: f["mbit_s"])
        rtt = statistics.median(rtts)
        exp_rtt = 2 * self.wan.delay_ms
        report: dict = {
            "src": a.name,
            "dst": b.name,
            "wan": str(self.wan),
            "rtt_ms": round(rtt, 3),
            "rtt_ms_p10_p90": [round(x, 3) for x in statistics.quantiles(rtts, n=10)[::8]],
            "expected_rtt_ms": exp_rtt,
            "mbit_s": round(flow["mbit_s"], 3),
            "expected_mbit_s": self.wan.rate_bit / 1e6 if self.wan.rate_bit else None,
            "tcp_goodput_mbit_s": round(self.wan.rate_bit * TCP_GOODPUT / 1e6, 3)
            if self.wan.rate_bit
            else None,
            "flow_seconds": round(flow["seconds"], 3),
            "flows_mbit_s": [round(f["mbit_s"], 3) for f in flows],
            "tolerance": TOLERANCE,
        }
        problems = []
        if self.wan.needs_relay or self.wan.rate_bit:
            allowed = max(TOLERANCE * exp_rtt, RTT_FLOOR_MS)
            if abs(rtt - exp_rtt) > allowed:
                problems.append(f"RTT {rtt:.2f} ms, expected {exp_rtt:g} ms +- {allowed:.2f}")
        if self.wan.rate_bit:
            exp = self.wan.rate_bit / 1e6
            if self.wan.loss > 0:  # what TCP makes of loss depends on its congestion control
                if flow["mbit_s"] > exp * (1 + TOLERANCE):
                    problems.append(f"throughput {flow['mbit_s']:.2f} Mbit/s above the rate {exp:g}")
            elif not self._rate_ok(flow["mbit_s"]):
                problems.append(
                    f"throughput {flow['mbit_s']:.2f} Mbit/s, expected {exp:g} +- {TOLERANCE:.0%}"
                )
        report["ok"] = not problems
        report["problems"] = problems
        log.info(
            "sites probe %s -> %s: RTT %.2f ms (expected %g), %.2f Mbit/s (expected %s)%s",
            a.name,
            b.name,
            rtt,
            exp_rtt,
            flow["mbit_s"],
            report["expected_mbit_s"],
            "" if not problems else ": " + "; ".join(problems),
        )
        if check and problems:
            raise SitesError(
                f"the WAN {self.wan} does not measure as specified ({'; '.join(problems)}); "
                "is the machine overloaded? see `medseg sites probe --report-only`"
            )
        return report


@contextlib.contextmanager
def testbed(
    sites: str | dict[str, int] = "a:2,b:2",
    wan: str | WanSpec = "none",
    cpu: str | dict[str, float] | None = None,
    **kwargs,
) -> Iterator[Testbed]:
    """``with testbed(sites="a:2,b:2", wan="20mbit:25ms") as tb: ...``: up, then always down."""
    tb = Testbed.up(sites, wan, cpu, **kwargs)
    try:
        yield tb
    finally:
        tb.down()


__all__ = [
    "SitesError",
    "Site",
    "Testbed",
    "WanSpec",
    "check_host",
    "down",
    "leftovers",
    "parse_cpu",
    "parse_sites",
    "parse_wan",
    "sweep",
    "testbed",
]
