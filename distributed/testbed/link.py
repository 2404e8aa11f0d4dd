"""The site link of a secure testbed: a WireGuard tunnel in every site and in the launcher.

``Testbed.up(..., secure=True)`` keys every member (``site-<name>`` for each site,
``msite-launcher`` for the launcher), writes each one's full-mesh config into
``/run/medseg-sites/wg`` (0700; keys and configs 0600) and starts one
:class:`~medseg.distributed.secure.tunnel.Tunnel` per member: in each site namespace, on the
interface ``msitewg`` with address 198.19.255.<i>/24 and UDP port 51820 on its WAN address, and in the
launcher's (root) namespace with 198.19.255.254/24 and no fixed port (the launcher only dials out,
so the sites list it without an endpoint). Site-to-site tunnel packets cross the emulated WAN (the
relay, the tbf shaping) as any other inter-site packet; launcher-to-site ones take the launcher's
undelayed link, as before. Every process is ``wireguard-go -f msitewg`` (the sweep finds them by
that exact command line, in any namespace), and each tunnel's TUN device goes with its process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from medseg.distributed.secure.tunnel import (
    Member,
    Tunnel,
    generate_keypair,
    mesh_config,
    write_secret,
)
from medseg.distributed.testbed.spec import (
    LAUNCHER_TUNNEL_IP,
    STATE_DIR,
    TUNNEL_NET,
    WG_IFACE,
    WG_PORT,
    Site,
)

KEY_DIR = STATE_DIR / "wg"
LAUNCHER = "msite-launcher"  # the launcher's member name (a site's is its hostname, site-<name>)
LAUNCHER_LOG = STATE_DIR / "wg-launcher.log"


def write_configs(sites: Sequence[Site]) -> dict[str, Member]:
    """Key every member and write its config (``<KEY_DIR>/<member>.conf``); returns the members."""
    keys = {name: generate_keypair(KEY_DIR, name) for name in [s.hostname for s in sites] + [LAUNCHER]}
    members = [
        Member(s.hostname, s.tunnel_ip, keys[s.hostname].public_key, s.wg_endpoint, WG_PORT) for s in sites
    ]
    members.append(Member(LAUNCHER, LAUNCHER_TUNNEL_IP, keys[LAUNCHER].public_key, None, None))
    for m in members:
        write_secret(KEY_DIR / f"{m.name}.conf", mesh_config(m, keys[m.name].private_key(), members))
    return {m.name: m for m in members}


def site_tunnel(site: Site) -> Tunnel:
    """The tunnel of a site (not started): in its namespace, logging to its folder."""
    return Tunnel(
        KEY_DIR / f"{site.hostname}.conf",
        f"{site.tunnel_ip}/{TUNNEL_NET.prefixlen}",
        iface=WG_IFACE,
        netns=site.netns,
        log_path=site.dir / "wg.log",
    )


def launcher_tunnel() -> Tunnel:
    """The launcher's tunnel (not started): in this (the root) network namespace."""
    return Tunnel(
        KEY_DIR / f"{LAUNCHER}.conf",
        f"{LAUNCHER_TUNNEL_IP}/{TUNNEL_NET.prefixlen}",
        iface=WG_IFACE,
        log_path=LAUNCHER_LOG,
    )


def start_tunnels(sites: Sequence[Site], record: Callable[[str, int], None]) -> dict[str, Member]:
    """Key, configure and start every member's tunnel; ``record(member, pid)`` after each start (the
    testbed saves the id in its state). On a failure the started ones keep running: the testbed's
    sweep ends them."""
    for site in sites:
        site.dir.mkdir(parents=True, exist_ok=True)
    members = write_configs(sites)
    for site in sites:
        record(site.hostname, site_tunnel(site).start())
    record(LAUNCHER, launcher_tunnel().start())
    return members
