"""``medseg sites``: the emulated hospital network on this machine (network namespaces, shaped WAN)."""

from __future__ import annotations

import argparse
import json

from medseg.errors import MedsegError


def _up(args: argparse.Namespace) -> None:
    from medseg.distributed.testbed.testbed import Testbed

    tb = Testbed.up(
        args.sites, args.wan, args.cpu, probe=False, lifetime_s=args.lifetime, owned=False, secure=args.secure
    )
    if not args.no_probe:
        try:
            report = tb.probe(check=True)
        except MedsegError:
            tb.down()  # a testbed off its spec is not left standing
            raise
        print(json.dumps(report, indent=1))
    print(json.dumps(tb.status(), indent=1))
    print(
        f"testbed up: medseg train --config C --np {sum(s.ranks for s in tb.sites)} --hosts {tb.hosts_arg()}"
    )
    print(
        f"with PATH={tb.bin_dir}:$PATH MEDSEG_HOROVODRUN_ARGS='{tb.launcher_env()['MEDSEG_HOROVODRUN_ARGS']}'"
    )


def _status(args: argparse.Namespace) -> None:
    from medseg.distributed.testbed.testbed import Testbed

    print(json.dumps(Testbed.current().status(), indent=1))


def _probe(args: argparse.Namespace) -> None:
    from medseg.distributed.testbed.testbed import Testbed

    report = Testbed.current().probe(check=not args.report_only, seconds=args.seconds)
    print(json.dumps(report, indent=1))


def _down(args: argparse.Namespace) -> None:
    from medseg.distributed.testbed.sweep import down

    removed = down()
    print("removed: " + ("; ".join(removed) if removed else "nothing"))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``medseg sites`` and its subcommands up, status, probe and down."""
    sites = subparsers.add_parser(
        "sites",
        help="emulated hospital network on this machine (root): namespaces, shaped WAN, sshd per site",
    ).add_subparsers(dest="sites_command", required=True)
    s = sites.add_parser("up", help="make the testbed (replacing a crashed one) and probe its WAN")
    s.add_argument("--sites", required=True, help="NAME:RANKS,... e.g. a:2,b:2")
    s.add_argument(
        "--wan",
        default="none",
        help="RATE:DELAY[:LOSS] between every two sites, e.g. 20mbit:25ms:0.1%%, or none; or one link per "
        "site to the router, SITE=RATE:DELAY[:LOSS],... (a=100mbit:5ms,b=20mbit:25ms: a to b is 20 Mbit/s, 30 ms)",
    )
    s.add_argument("--cpu", help="SITE=CORES per rank, e.g. a=0.5,b=0.25 (cgroup CPU quota; optional)")
    s.add_argument("--no-probe", action="store_true", help="skip the RTT and throughput check")
    s.add_argument(
        "--secure",
        action="store_true",
        help="join the sites by a WireGuard tunnel (wireguard-go) and give jobs the tunnel addresses",
    )
    s.add_argument("--lifetime", type=float, default=4 * 3600, help="seconds the WAN relay lives at most")
    s.set_defaults(func=_up)
    s = sites.add_parser("status", help="print the testbed's sites, WAN and processes as JSON")
    s.set_defaults(func=_status)
    s = sites.add_parser("probe", help="measure RTT and throughput between two sites against the spec")
    s.add_argument("--report-only", action="store_true", help="print the report; exit 0 even when off spec")
    s.add_argument("--seconds", type=float, default=3.0, help="length of the throughput flow")
    s.set_defaults(func=_probe)
    s = sites.add_parser(
        "down",
        help="remove every namespace, link, cgroup, process and file of the testbed (also half-made ones)",
    )
    s.set_defaults(func=_down)
