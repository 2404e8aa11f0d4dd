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

Secure (``Testbed.up(..., secure=True)``, ``medseg sites up --secure``): the site link of
:mod:`.link` (a WireGuard tunnel, :mod:`medseg.distributed.secure.tunnel`) runs in every site and in
the launcher, and everything a job uses names the tunnel: ``--hosts`` (:meth:`Testbed.hosts_arg`),
the sites' /etc/hosts, sshd's ``ListenAddress``, the common interface ``msitewg`` in
``--network-interfaces``/``HOROVOD_GLOO_IFACE`` and the launcher's ``MEDSEG_BEAT_HOST``. So ssh,
Horovod, Gloo and heartbeats ride the tunnel, and a site's WAN address answers only on the tunnel's
UDP port 51820 (sockets a job binds to 0.0.0.0 are the exception: see docs/design.md).

Nothing here reaches the real network: sites route only 198.18.0.0/15, the router knows only its
connected /24s, and the root namespace does not forward. Every name we make starts with ``msite``
(``medseg-sites`` for the cgroup and ``/run/medseg-sites`` for keys, configs and the state file),
so ``down`` (and ``up`` after a crash) sweeps by prefix and also removes what a half-finished
``up`` left behind.

The parts: :mod:`.spec` (specs, names, addresses), :mod:`.netns` (namespaces, links, routes, tbf,
the relay's TUN devices), :mod:`.relay` (the WAN's delay and loss), :mod:`.ssh` (per-site sshd),
:mod:`.cgroups` (CPU quotas), :mod:`.probe` (link measurements), :mod:`.counters` (WAN bytes),
:mod:`.sweep` (removal), :mod:`.state` (state file, lock) and :mod:`.host` (checks, commands,
processes); this module puts them together.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

from medseg.distributed.testbed import cgroups, counters, link, netns, ssh
from medseg.distributed.testbed.host import alive, check_host, run
from medseg.distributed.testbed.probe import probe_wan
from medseg.distributed.testbed.spec import (
    IFACE,
    LAUNCHER_IP,
    LAUNCHER_TUNNEL_IP,
    ROUTER_NS,
    STATE_DIR,
    WG_IFACE,
    Network,
    Site,
    SitesError,
    WanSpec,
    parse_cpu,
    parse_network,
    parse_sites,
)
from medseg.distributed.testbed.state import lock, read_state, write_state
from medseg.distributed.testbed.sweep import sweep

log = logging.getLogger(__name__)


class Testbed:
    """A running emulated hospital network; made by :meth:`up`, found again by :meth:`current`.

    The state lives in ``/run/medseg-sites/state.json``, so a CLI ``medseg sites up`` in one
    process and ``Testbed.current().probe()`` in another see the same testbed.
    """

    def __init__(self, state: dict) -> None:
        self.state = state
        self.sites = [Site(**s) for s in state["sites"]]
        self.wan = Network.from_state(state["wan"])
        self.secure = bool(state.get("secure"))

    @classmethod
    def up(
        cls,
        sites: str | dict[str, int],
        wan: str | WanSpec | Network = "none",
        cpu: str | dict[str, float] | None = None,
        *,
        probe: bool = True,
        lifetime_s: float = 4 * 3600,
        owned: bool = True,
        secure: bool = False,
    ) -> Testbed:
        """Build the testbed (cleaning up a crashed one first); with ``probe``, check its shaping.

        ``secure``: bring up the site link (a WireGuard tunnel in every site and in the launcher) and
        give jobs the tunnel addresses (see the module's docstring).

        ``owned``: the testbed belongs to this process; another ``up`` refuses to replace it while
        this process lives (the CLI's ``medseg sites up`` passes False: its testbed outlives it and
        the next ``up`` replaces it). ``lifetime_s`` bounds the relay (the WAN stops after it).
        Any failure, the probe's included, removes everything made so far and raises SitesError.
        """
        state = _initial_state(sites, wan, cpu, lifetime_s=lifetime_s, owned=owned, secure=secure)
        with lock():
            old = read_state()
            if old and old.get("owner_pid") and old["owner_pid"] != os.getpid() and alive(old["owner_pid"]):
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
                if tb.wan.links:
                    tb.probe_pairs(check=True)
                else:
                    tb.probe(check=True)
            except BaseException:
                tb.down()
                raise
        return tb

    @classmethod
    def current(cls) -> Testbed:
        """The testbed that is up on this machine (from its state file), or SitesError."""
        state = read_state()
        if not state or state.get("status") != "up":
            raise SitesError(
                "no testbed is up: start one with `medseg sites up --sites a:2,b:2 --wan 20mbit:25ms`"
            )
        return cls(state)

    def down(self) -> list[str]:
        """Remove every namespace, veth, cgroup, process and file of the testbed; returns what went."""
        with lock():
            state = read_state()
            if state and state.get("created") != self.state.get("created"):
                log.warning("sites: the testbed on this machine is not this one any more; removing it anyway")
            removed = sweep()
        log.info("sites: down (%d kinds of things removed)", len(removed))
        return removed

    def _save(self) -> None:
        write_state(self.state)

    def _build(self) -> None:
        t0 = time.monotonic()
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._save()
        netns.check_routes()
        netns.make_router(self.wan)
        for site in self.sites:
            netns.make_site(site, self.sites, self.wan)
        if self.wan.needs_relay:
            self._start_relay()
        cgroups.make_cgroups(self.sites)
        if self.secure:
            self._start_tunnels()
        if ssh.make_client(self.sites):
            self.state["made_run_sshd"] = True
            self._save()
        for site in self.sites:
            self._start_sshd(site)
        for site in self.sites:
            ssh.wait_sshd(site, self.state["pids"]["sshd"][site.name])
        self.state["status"] = "up"
        self._save()
        log.info(
            "sites: up in %.1f s: %s; WAN %s",
            time.monotonic() - t0,
            ", ".join(f"{s.hostname} {s.ip} x{s.ranks}" for s in self.sites),
            self.wan,
        )

    def _start_relay(self) -> None:
        proc = netns.start_relay(self.wan, self.sites, self.state["lifetime_s"])
        self.state["pids"]["relay"] = proc.pid
        self._save()
        netns.wait_relay_attached(proc)

    def _start_tunnels(self) -> None:
        from medseg.distributed.secure.tunnel import prepare_socket_dir

        if prepare_socket_dir():
            self.state["made_run_wireguard"] = True
            self._save()

        def record(member: str, pid: int) -> None:
            self.state["pids"]["wg"][member] = pid
            self._save()

        self.state["pids"].setdefault("wg", {})
        link.start_tunnels(self.sites, record)

    def _start_sshd(self, site: Site) -> None:
        proc = ssh.start_sshd(site)
        self.state["pids"]["sshd"][site.name] = proc.pid
        self._save()

    @property
    def ssh_config(self) -> Path:
        return ssh.SSH_CONFIG

    @property
    def bin_dir(self) -> Path:
        """Put first on PATH: its ``ssh`` uses the testbed's key and config (horovodrun calls plain ssh)."""
        return ssh.BIN_DIR

    def site(self, name: str) -> Site:
        for s in self.sites:
            if s.name == name:
                return s
        raise SitesError(f"no site {name!r} in this testbed (sites: {', '.join(s.name for s in self.sites)})")

    def site_ip(self, name: str) -> str:
        """The address jobs use for a site: its tunnel address when secure, else its WAN address."""
        return self.site(name).job_ip

    def wan_ip(self, name: str) -> str:
        """A site's address on the emulated WAN (198.18.<i>.1), secure or not."""
        return self.site(name).ip

    @property
    def iface(self) -> str:
        """The interface every job names (launcher and sites alike): the tunnel's when secure."""
        return WG_IFACE if self.secure else IFACE

    @property
    def launcher_ip(self) -> str:
        """The launcher's address as the sites reach it: in the tunnel when secure."""
        return LAUNCHER_TUNNEL_IP if self.secure else LAUNCHER_IP

    def hosts_arg(self) -> str:
        """The ``--hosts`` value: ``198.18.1.1:2,198.18.2.1:2`` (site IPs, resolvable in the launcher;
        the tunnel addresses 198.19.255.<i> when secure)."""
        return ",".join(f"{s.job_ip}:{s.ranks}" for s in self.sites)

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
        env["MEDSEG_HOROVODRUN_ARGS"] = f"--network-interfaces {self.iface} --disable-cache"
        env["MEDSEG_BEAT_HOST"] = self.launcher_ip
        env["HOROVOD_GLOO_IFACE"] = self.iface
        return env

    def site_prefix(self, name: str) -> list[str]:
        """argv prefix that runs a command as a rank of that site would run: its network, hostname,
        /etc/hosts and CPU cgroup (entered through the namespaces of the site's sshd)."""
        site = self.site(name)
        pid = self.state["pids"]["sshd"].get(site.name)
        if not alive(pid):
            raise SitesError(f"sshd of {site.hostname} is not running; bring the testbed up again")
        join = cgroups.join_command(site, "; ")
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
        run(["ip", "-n", ROUTER_NS, "link", "set", self.site(name).router_dev, "down"])
        log.info("sites: cut %s", name)

    def restore(self, name: str) -> None:
        """Bring a cut site link back up."""
        run(["ip", "-n", ROUTER_NS, "link", "set", self.site(name).router_dev, "up"])
        log.info("sites: restored %s", name)

    def wan_counters(self) -> dict:
        """Bytes and packets that crossed between sites, counted at the WAN boundary
        (:func:`~medseg.distributed.testbed.counters.wan_counters`)."""
        return counters.wan_counters(self.wan, self.sites)

    def status(self) -> dict:
        """What is up: sites (address, hostname, ranks, CPU quota, sshd), the WAN and the relay."""
        stats = netns.link_stats(ROUTER_NS) if ROUTER_NS in netns.our_namespaces() else {}
        sites = [
            {
                "name": s.name,
                "hostname": s.hostname,
                "ip": s.job_ip,
                "wan_ip": s.ip,
                "netns": s.netns,
                "ranks": s.ranks,
                "cores_per_rank": s.cores_per_rank,
                "cpu_quota_cores": cgroups.quota_cores(s),
                "sshd_alive": alive(self.state["pids"]["sshd"].get(s.name)),
                "link_up": "UP" in stats.get(s.router_dev, {}).get("flags", []),
                "tunnel_alive": alive(self.state["pids"].get("wg", {}).get(s.hostname))
                if self.secure
                else None,
            }
            for s in self.sites
        ]
        relay = self.state["pids"].get("relay")
        return {
            "status": self.state.get("status"),
            "owner_pid": self.state.get("owner_pid"),
            "wan": str(self.wan),
            "relay_alive": alive(relay) if relay else None,
            "secure": self.secure,
            "launcher_ip": self.launcher_ip,
            "hosts": self.hosts_arg(),
            "sites": sites,
        }

    def probe_pairs(self, check: bool = True, seconds: float = 3.0) -> dict[str, dict]:
        """:meth:`probe` every pair of sites (``"a-b"``: a to b), each against its own path."""
        names = [s.name for s in self.sites]
        return {
            f"{a}-{b}": self.probe(a, b, check=check, seconds=seconds)
            for i, a in enumerate(names)
            for b in names[i + 1 :]
        }

    def probe(
        self,
        src: str | None = None,
        dst: str | None = None,
        check: bool = True,
        seconds: float = 3.0,
        tunnel: bool = False,
    ) -> dict:
        """Measure RTT and throughput between two sites (default the first two) against their path's
        spec (:meth:`Network.path`; :func:`~medseg.distributed.testbed.probe.probe_wan`); with
        ``check``, SitesError when off.
        ``tunnel``: between the sites' tunnel addresses (a secure testbed's job path) instead of their
        WAN addresses. The default is the WAN addresses, secure or not: what ``up`` checks is the
        emulation, and the tunnel adds its own cost (user-space crypto, 60 bytes a packet: about 4 %
        less throughput, and on a busy machine a few ms of scheduling delay per round trip)."""
        if len(self.sites) < 2:
            raise SitesError("probe: the testbed has one site; the WAN needs two")
        a = self.site(src) if src else self.sites[0]
        b = self.site(dst) if dst else self.sites[1]
        if tunnel and not self.secure:
            raise SitesError("probe: this testbed has no site link (bring it up with --secure)")
        return probe_wan(self.wan.path(a.name, b.name), a, b, check=check, seconds=seconds, tunnel=tunnel)


def _initial_state(
    sites: str | dict[str, int],
    wan: str | WanSpec | Network,
    cpu: str | dict[str, float] | None,
    *,
    lifetime_s: float,
    owned: bool,
    secure: bool = False,
) -> dict:
    """The state of a testbed about to come up, from the specs (checked, as is the host)."""
    names = parse_sites(sites)
    network = parse_network(wan, list(names))
    cores = parse_cpu(cpu, names)
    check_host(cpu=bool(cores), secure=secure)
    site_list = [Site(n, i + 1, r, cores.get(n), secure) for i, (n, r) in enumerate(names.items())]
    quota = sum(s.ranks * s.cores_per_rank for s in site_list if s.cores_per_rank)
    ncpu = os.cpu_count() or 1
    if quota and quota >= ncpu:
        log.warning(
            "sites: the CPU quotas add up to %.2f cores but this machine has %d: the sites will compete "
            "for real cores and the emulated speed ratios will not hold",
            quota,
            ncpu,
        )
    return {
        "version": 1,
        "status": "coming-up",
        "owner_pid": os.getpid() if owned else None,
        "created": time.time(),
        "sites": [asdict(s) for s in site_list],
        "wan": network.as_state(),
        "lifetime_s": lifetime_s,
        "secure": secure,
        "pids": {"sshd": {}, "wg": {}},
    }


@contextlib.contextmanager
def testbed(
    sites: str | dict[str, int] = "a:2,b:2",
    wan: str | WanSpec | Network = "none",
    cpu: str | dict[str, float] | None = None,
    **kwargs,
) -> Iterator[Testbed]:
    """``with testbed(sites="a:2,b:2", wan="20mbit:25ms") as tb: ...`` (or one link per site,
    ``wan="a=100mbit:5ms,b=20mbit:25ms"``): up, then always down."""
    tb = Testbed.up(sites, wan, cpu, **kwargs)
    try:
        yield tb
    finally:
        tb.down()
