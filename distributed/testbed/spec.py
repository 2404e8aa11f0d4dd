"""What a testbed is made of: the WAN and site specs as the command line gives them, and the names
and addresses every part of the testbed uses.

Every address is in 198.18.0.0/15, the range reserved for network benchmarks (RFC 2544): the
launcher is 198.18.0.1, site ``i`` (counted from 1) is 198.18.<i>.1 behind the router's
198.18.<i>.254. A secure testbed adds the site link (a WireGuard tunnel, interface ``msitewg``,
UDP port 51820): site ``i`` is 198.19.255.<i> inside it and the launcher 198.19.255.254, and
jobs use those addresses (:attr:`Site.job_ip`). Every name starts with ``msite`` (``medseg-sites`` for the cgroup and
``/run/medseg-sites`` for keys, configs and the state file), so a sweep by prefix finds all of it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from medseg.errors import MedsegError

PREFIX = "msite-"  # network namespaces and /etc/netns folders
IFACE = "msite0"  # each site's interface and the launcher's: one name, as horovodrun needs
ROUTER_NS = "msite-router"
LAUNCHER_DEV = "to-l"
TUN_IN, TUN_OUT = "wan-in", "wan-out"
WAN_TABLE = 100
NETWORK = ipaddress.ip_network("198.18.0.0/15")
LAUNCHER_IP = "198.18.0.1"
STATE_DIR = Path("/run/medseg-sites")
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
CGROUP_NAME = "medseg-sites"
# The site link of a secure testbed (medseg.distributed.secure.tunnel): one interface name in every
# member (horovodrun's --network-interfaces names one interface for all hosts), a tunnel subnet
# apart from the sites' 198.18.<i>.0/24, and the one UDP port a site opens to the WAN.
WG_IFACE = "msitewg"
WG_PORT = 51820
TUNNEL_NET = ipaddress.ip_network("198.19.255.0/24")
LAUNCHER_TUNNEL_IP = "198.19.255.254"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class SitesError(MedsegError):
    """The testbed cannot be made, used or checked; the message says what to install or undo."""


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
    rate = None if parts[0] == "none" else _parse_rate(spec, parts[0])
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


def _parse_rate(spec: str, text: str) -> int:
    """The RATE part of a ``--wan`` spec in bit/s (at least 8 kbit/s)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", text)
    if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise SitesError(f"--wan {spec!r}: rate {text!r} is not a number with one of {sorted(_RATE_UNITS)}")
    rate = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if rate < 8000:
        raise SitesError(f"--wan {spec!r}: rate below 8kbit is not a network tbf can emulate")
    return rate


@dataclass(frozen=True)
class Network:
    """The emulated WAN: one spec for every path between two sites (``shared``, ``--wan 20mbit:25ms``),
    or one link per site to the router (``links``, ``--wan a=100mbit:5ms,b=20mbit:25ms``).

    With links, the path from site i to site j crosses both: its rate is min(r_i, r_j) (each link is
    shaped to its own rate at both of its ends), its one-way delay d_i + d_j and its loss
    1 - (1 - l_i)(1 - l_j) (:meth:`path`). ``shared`` is then ``none``.
    """

    shared: WanSpec
    links: tuple[tuple[str, WanSpec], ...] = ()

    @property
    def per_site(self) -> dict[str, WanSpec]:
        return dict(self.links)

    def link(self, site: str) -> WanSpec:
        """What shapes ``site``'s own link (its rate; the shared spec without per-site links)."""
        return self.per_site.get(site, self.shared)

    def path(self, a: str, b: str) -> WanSpec:
        """The path between two sites, as a probe measures it."""
        if not self.links:
            return self.shared
        la, lb = self.link(a), self.link(b)
        rates = [r for r in (la.rate_bit, lb.rate_bit) if r]
        return WanSpec(
            min(rates) if rates else None, la.delay_ms + lb.delay_ms, 1 - (1 - la.loss) * (1 - lb.loss)
        )

    @property
    def shaped(self) -> bool:
        return self.shared.shaped or any(s.shaped for _, s in self.links)

    @property
    def needs_relay(self) -> bool:
        return self.shared.needs_relay or any(s.needs_relay for _, s in self.links)

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.links) if self.links else str(self.shared)

    def as_state(self) -> dict:
        return {"shared": asdict(self.shared), "links": [[n, asdict(s)] for n, s in self.links]}

    @classmethod
    def from_state(cls, state: dict) -> Network:
        if "shared" not in state:  # a state file written before per-site links: the shared spec
            return cls(WanSpec(**state))
        return cls(WanSpec(**state["shared"]), tuple((n, WanSpec(**s)) for n, s in state["links"]))


def parse_network(spec: str | WanSpec | Network, sites: Sequence[str]) -> Network:
    """``--wan``: one spec for every path (:func:`parse_wan`) or ``SITE=SPEC,...`` naming every site once."""
    if isinstance(spec, Network):
        if not spec.links:
            return spec
        network = spec
    elif isinstance(spec, WanSpec) or "=" not in spec:
        return Network(parse_wan(spec))
    else:
        links = []
        for item in spec.split(","):
            name, _, text = item.strip().partition("=")
            links.append((name, parse_wan(text)))
        network = Network(parse_wan("none"), tuple(links))
    names = [n for n, _ in network.links]
    if sorted(names) != sorted(sites) or len(set(names)) != len(names):
        raise SitesError(
            f"--wan {spec}: with one link per site, name every site once ({', '.join(sites)}), e.g. "
            + ",".join(f"{s}=20mbit:25ms" for s in sites)
        )
    return network


def dilate(wan: WanSpec, k: float) -> WanSpec:
    """The link a k-times slower computer must see so that its runs keep a faster one's ratio of
    communication to compute (time dilation, Gupta et al., DieCast, NSDI 2007): rate / k, delay x k;
    loss is a per-packet fraction and stays."""
    if k <= 0:
        raise SitesError(f"time dilation: the factor must be > 0 (got {k:g})")
    rate = None if wan.rate_bit is None else max(int(round(wan.rate_bit / k)), 8000)
    return WanSpec(rate, wan.delay_ms * k, wan.loss)


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
    """One emulated hospital: a namespace ``msite-<name>`` with address 198.18.<index>.1 (``ip``, its
    WAN address) and, in a secure testbed, 198.19.255.<index> in the site link (``tunnel_ip``)."""

    name: str
    index: int
    ranks: int
    cores_per_rank: float | None
    secure: bool = False

    @property
    def tunnel_ip(self) -> str:
        return str(TUNNEL_NET.network_address + self.index)

    @property
    def job_ip(self) -> str:
        """The address jobs use (``--hosts``, /etc/hosts, sshd): the tunnel's when secure, else ``ip``."""
        return self.tunnel_ip if self.secure else self.ip

    @property
    def wg_endpoint(self) -> str:
        return f"{self.ip}:{WG_PORT}"

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
