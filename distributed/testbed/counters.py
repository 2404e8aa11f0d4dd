"""Bytes and packets that crossed the emulated WAN between sites, counted at its boundary."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from medseg.distributed.testbed.netns import RELAY_STATS, link_stats
from medseg.distributed.testbed.spec import LAUNCHER_DEV, ROUTER_NS, TUN_IN, TUN_OUT, Network, Site

ETHERNET_HEADER = 14  # bytes a veth counts per packet beyond the IP packet


def wan_counters(wan: Network, sites: Sequence[Site]) -> dict:
    """Bytes and packets that crossed between sites, counted at the WAN boundary.

    With a relay (any delay or loss): the kernel's counters of the relay's TUN devices in the
    router namespace, which carry inter-site packets only (launcher traffic never enters them):
    ``bytes``/``packets`` are IP packets (headers included, no Ethernet header) the sites sent
    into the WAN, ``delivered_*`` those that came out (after loss). ``links`` gives per site
    the bytes and packets it sent and received over the WAN, and ``tcp`` what the relay saw
    inside them (exact header and payload bytes, retransmitted payload: ``relay.Counters``), from
    the relay's own counters (updated every 0.5 s). Without a relay (``--wan none`` or rate only):
    the router's veth counters, sites' received minus what went to the launcher, Ethernet headers
    removed (ARP and the like make this approximate); ``source`` says which.
    The relay's counters are waited for (up to 2 s) until it has written them after this call
    began: a stale file would move the end of an earlier transfer (the probe's) into the next
    measurement.
    """
    if wan.needs_relay:
        _wait_for_relay_stats(since=time.time())
    stats = link_stats(ROUTER_NS)
    if wan.needs_relay:
        return _relay_counters(stats, sites)
    return _veth_counters(stats, sites)


def _wait_for_relay_stats(since: float, timeout: float = 2.0) -> None:
    """Wait (at most ``timeout`` s) until the relay's counters file was written at or after ``since``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(RELAY_STATS.read_text()).get("time", 0) >= since:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)


def _relay_counters(stats: dict[str, dict], sites: Sequence[Site]) -> dict:
    """Totals from the relay's TUN devices, per-site links and TCP detail from the relay's own counters."""
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
        for s in sites
    }
    by_index = {s.index: s.name for s in sites}
    try:
        relay_stats = json.loads(RELAY_STATS.read_text())
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


def _veth_counters(stats: dict[str, dict], sites: Sequence[Site]) -> dict:
    """The router's veth counters: what the sites sent, less what went to the launcher (approximate)."""
    rx = sum(stats[s.router_dev]["stats64"]["rx"]["bytes"] for s in sites)
    rxp = sum(stats[s.router_dev]["stats64"]["rx"]["packets"] for s in sites)
    to_l = stats[LAUNCHER_DEV]["stats64"]["tx"]
    packets = rxp - to_l["packets"]
    return {
        "source": "router veths minus launcher traffic (approximate)",
        "bytes": rx - to_l["bytes"] - ETHERNET_HEADER * packets,
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
            for s in sites
        },
    }
