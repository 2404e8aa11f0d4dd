"""The site link on the emulated hospital network: two sites joined by WireGuard over the shaped WAN.

An outsider on the WAN side (a namespace on the router) scans each site's WAN address and must find
only the tunnel's UDP port; a capture on the WAN during a transfer between tunnel addresses must not
contain the bytes sent, while the same transfer between WAN addresses does (so the check can fail).
Needs root, iproute2, sshd, wireguard-go, wg and tcpdump (``make sites-deps``); otherwise every test
here skips with the reason. One testbed serves the module; its teardown checks nothing is left.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from medseg.distributed.secure.tunnel import TunnelError, stop_process
from medseg.distributed.testbed import link, outsider
from medseg.distributed.testbed import testbed as sites  # not its names: pytest would collect them
from medseg.distributed.testbed.host import check_host
from medseg.distributed.testbed.netns import socket_in
from medseg.distributed.testbed.probe import tcp_connects
from medseg.distributed.testbed.spec import ROUTER_NS, WG_IFACE, WG_PORT, SitesError
from medseg.distributed.testbed.sweep import leftovers

MARKER = b"MEDSEG|CANARY|16"  # 16 bytes, sent 65536 times (1 MiB)
JOB_PORTS = [22, 2222, 8080, 29500, 29501] + list(range(32768, 32868))  # ssh, store-like, ephemeral


def _host_problem() -> str | None:
    try:
        check_host(secure=True)
    except SitesError as exc:
        return str(exc)
    if shutil.which("tcpdump") is None:
        return "tcpdump is missing: run `make sites-deps`"
    return None


pytestmark = pytest.mark.skipif(
    _host_problem() is not None, reason=f"no secure testbed here: {_host_problem()}"
)


def test_a_failure_while_the_tunnels_come_up_leaves_nothing(monkeypatch) -> None:
    """The launcher's tunnel fails after both sites' tunnels started: everything goes, keys included."""
    broken = link.launcher_tunnel()
    broken.config = Path("/nonexistent/msite-launcher.conf")
    monkeypatch.setattr(link, "launcher_tunnel", lambda: broken)
    with pytest.raises(TunnelError, match="does not exist"):
        sites.Testbed.up("a:1,b:1", "20mbit:5ms", probe=False, secure=True)
    assert leftovers() == []
    assert not link.KEY_DIR.exists()


@pytest.fixture(scope="module")
def tb() -> Iterator[sites.Testbed]:
    run_wireguard_existed = Path("/run/wireguard").exists()
    with sites.testbed(sites="a:1,b:1", wan="20mbit:25ms", probe=False, secure=True) as bed:
        yield bed
    assert leftovers() == []
    assert Path("/run/wireguard").exists() == run_wireguard_existed


def _wg_dump(tb: sites.Testbed, member: str) -> list[list[str]]:
    """``wg show msitewg dump`` of a member's tunnel, its peers' lines only (the first holds the private key)."""
    pid = tb.state["pids"]["wg"][member]
    argv = ["nsenter", f"--target={pid}", "--mount", "--net", "--", "wg", "show", WG_IFACE, "dump"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout
    return [line.split("\t") for line in out.splitlines()[1:]]


def test_sites_and_launcher_talk_over_the_tunnel_addresses(tb: sites.Testbed) -> None:
    a, b = tb.site("a"), tb.site("b")
    assert tb.hosts_arg() == "198.19.255.1:1,198.19.255.2:1"
    env = tb.launcher_env({})
    assert env["MEDSEG_HOROVODRUN_ARGS"].startswith(f"--network-interfaces {WG_IFACE} ")
    assert env["HOROVOD_GLOO_IFACE"] == WG_IFACE and env["MEDSEG_BEAT_HOST"] == "198.19.255.254"
    assert tcp_connects(a, b, timeout=5, addr=b.tunnel_ip) and tcp_connects(b, a, timeout=5, addr=a.tunnel_ip)
    # what Horovod's Gloo relies on: the site names resolve to tunnel addresses inside every site
    out = tb.exec_in("a", ["sh", "-c", "getent hosts site-b; getent hosts msite-launcher"])
    assert out.stdout.split() == ["198.19.255.2", "site-b", "198.19.255.254", "msite-launcher"], out
    # the launcher's ssh reaches each site through the tunnel (sshd listens on the tunnel address only)
    for site in tb.sites:
        proc = subprocess.run(
            [str(tb.bin_dir / "ssh"), site.tunnel_ip, "hostname"], capture_output=True, text=True, timeout=30
        )
        assert proc.stdout.strip() == site.hostname, proc.stderr
    # every pair of members did a WireGuard handshake, authenticated by the keys in the configs
    keys = {m: (link.KEY_DIR / f"{m}.pub").read_text().strip() for m in ("site-a", "site-b", link.LAUNCHER)}
    for member in keys:
        peers = {line[0]: line for line in _wg_dump(tb, member)}
        assert set(peers) == {k for m, k in keys.items() if m != member}
        assert all(int(line[4]) > 0 for line in peers.values()), (member, peers)  # latest handshake
    # keys and configs are readable by root only
    for path in link.KEY_DIR.iterdir():
        if path.suffix in (".key", ".conf"):
            assert path.stat().st_mode & 0o077 == 0, path
    assert tb.status()["secure"] is True and all(s["tunnel_alive"] for s in tb.status()["sites"])


def _listen(netns: str, addr: str) -> socket.socket:
    s = socket_in(netns)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 0))
    s.listen(8)
    return s


def test_an_outsider_on_the_wan_finds_only_the_wireguard_port(tb: sites.Testbed) -> None:
    with outsider.attacker() as atk:
        for site in tb.sites:
            outsider.allow_icmp_errors(site.netns)
            tcp = outsider.scan_tcp(atk, site.ip, range(1, 65536))
            assert tcp["open"] == [] and tcp["filtered"] == [], (site.name, tcp["open"], tcp["filtered"][:20])
            assert len(tcp["closed"]) == 65535  # every port answered: a real scan, not a dead link
            udp = outsider.scan_udp(atk, site.ip, range(1, 65536))
            assert udp["silent"] == [WG_PORT] and udp["answered"] == [], (site.name, udp["silent"][:20])
            # the tunnel addresses are not routed on the WAN: nothing there answers an outsider
            inside = outsider.scan_tcp(atk, site.tunnel_ip, JOB_PORTS, timeout=1.0, retries=0)
            assert inside["open"] == [] and inside["closed"] == [], inside
        # What a job's sockets must do: one bound to the tunnel address is invisible from the WAN,
        # one bound to 0.0.0.0 (as torch's TCPStore and an unbound heartbeat server are) is found.
        a = tb.site("a")
        bound = _listen(a.netns, a.tunnel_ip)
        anywhere = _listen(a.netns, "0.0.0.0")
        try:
            ports = [bound.getsockname()[1], anywhere.getsockname()[1]]
            found = outsider.scan_tcp(atk, a.ip, ports)
            assert found["open"] == [anywhere.getsockname()[1]], found
        finally:
            bound.close()
            anywhere.close()


def _capture_send(tb: sites.Testbed, path: Path, addr: str) -> list[bytes]:
    """1 MiB of MARKER from site a to site b at ``addr``, captured on the router's link to site b."""
    a, b = tb.site("a"), tb.site("b")
    with outsider.capture(ROUTER_NS, b.router_dev, path, max_packets=20_000, max_seconds=60):
        assert outsider.send_bytes(a, b, addr, MARKER * 65536, timeout=60) == len(MARKER) * 65536
    return outsider.pcap_packets(path)


def test_a_capture_on_the_wan_holds_no_plaintext_between_tunnel_addresses(
    tb: sites.Testbed, tmp_path: Path
) -> None:
    b = tb.site("b")
    sealed = _capture_send(tb, tmp_path / "tunnel.pcap", b.tunnel_ip)
    plain = _capture_send(tb, tmp_path / "plain.pcap", b.ip)
    # The control: the same bytes sent between WAN addresses are there for anyone on the path to read.
    hits = (tmp_path / "plain.pcap").read_bytes().count(MARKER)
    assert hits > 30_000, f"only {hits} copies of the marker in the plaintext capture"
    assert sum(len(p) for p in plain) > len(MARKER) * 65536
    # Through the tunnel: more than the payload crossed, none of it readable, and every packet on the
    # WAN is WireGuard's UDP (site to site and launcher to site alike).
    sealed_file = (tmp_path / "tunnel.pcap").read_bytes()
    hits = sealed_file.count(MARKER)
    assert hits == 0, f"{hits} copies of the marker in clear on the WAN"
    assert MARKER[:8] not in sealed_file
    assert sum(len(p) for p in sealed) > len(MARKER) * 65536
    flows = outsider.flows(sealed)
    assert flows and all(k[0] == "udp" and WG_PORT in (k[2], k[4]) for k in flows), flows


def _wan_bytes(tb: sites.Testbed, addr: str, payload: bytes) -> int:
    """Bytes that crossed the WAN (relay counters) while ``payload`` went from site a to b at ``addr``."""
    before = tb.wan_counters()["bytes"]
    outsider.send_bytes(tb.site("a"), tb.site("b"), addr, payload, timeout=60)
    time.sleep(0.6)  # the relay writes its counters every 0.5 s
    return tb.wan_counters()["bytes"] - before


def test_the_tunnel_costs_a_few_per_cent_of_the_link(tb: sites.Testbed, tmp_path: Path) -> None:
    """Throughput and WAN bytes through the tunnel against the plain path, measured side by side."""
    tunnel = tb.probe(check=True, tunnel=True)  # through the tunnel, checked against the WAN's spec
    plain = tb.probe(check=True)
    assert tunnel["path"] == "tunnel" and plain["path"] == "wan"
    ratio = tunnel["mbit_s"] / plain["mbit_s"]
    payload = b"\0" * (4 << 20)
    wire = {
        "tunnel": _wan_bytes(tb, tb.site("b").tunnel_ip, payload),
        "plain": _wan_bytes(tb, tb.site("b").ip, payload),
    }
    report = {
        "wan": str(tb.wan),
        "tunnel_mbit_s": tunnel["mbit_s"],
        "plain_mbit_s": plain["mbit_s"],
        "throughput_ratio": round(ratio, 4),
        "tunnel_rtt_ms": tunnel["rtt_ms"],
        "plain_rtt_ms": plain["rtt_ms"],
        "wan_bytes_per_payload_byte": {k: round(v / len(payload), 4) for k, v in wire.items()},
    }
    (tmp_path / "site-link.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    assert 0.90 <= ratio <= 1.0, report  # 1368/1494 vs 1448/1514 of each frame: 0.957 expected
    assert tunnel["rtt_ms"] - plain["rtt_ms"] < 5.0, report  # user-space crypto: < 1 ms idle, a few busy
    assert 1.0 < wire["tunnel"] / wire["plain"] < 1.10, report


def test_a_site_whose_tunnel_dies_is_cut_off_and_nothing_goes_in_clear(
    tb: sites.Testbed, tmp_path: Path
) -> None:
    """Without its tunnel process a site loses its tunnel address; a peer's traffic to it stays
    encrypted (or is dropped), never falls back to the WAN in clear. Last in the module: it kills
    site b's tunnel."""
    a, b = tb.site("a"), tb.site("b")
    assert stop_process(tb.state["pids"]["wg"][b.hostname], WG_IFACE)
    assert tb.status()["sites"][1]["tunnel_alive"] is False
    assert tb.exec_in("b", ["ip", "-o", "link", "show", WG_IFACE]).returncode != 0  # the TUN went too
    path = tmp_path / "dead.pcap"
    with outsider.capture(ROUTER_NS, b.router_dev, path, max_packets=1000, max_seconds=30):
        client = socket_in(a.netns)
        client.settimeout(2.0)
        try:
            with pytest.raises(OSError):
                client.connect((b.tunnel_ip, 22))
        finally:
            client.close()
    flows = outsider.flows(outsider.pcap_packets(path))
    assert any(k[0] == "udp" and k[1] == a.ip and k[4] == WG_PORT for k in flows), flows  # a tried
    # only WireGuard's UDP and b's "port unreachable" for it; no TCP in clear
    assert all(k[0] == "icmp" or (k[0] == "udp" and WG_PORT in (k[2], k[4])) for k in flows), flows


def _listening_ports(netns: str) -> list[int]:
    """The TCP ports something listens on in ``netns`` (any address)."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "ss", "-ltnH"], capture_output=True, text=True, timeout=20, check=True
    ).stdout
    return sorted({int(line.split()[3].rpartition(":")[2]) for line in out.splitlines() if line.strip()})


def test_a_horovod_job_runs_over_the_tunnel_and_the_wan_carries_only_wireguard(tmp_path: Path) -> None:
    """``medseg train`` across two secure sites: ssh launch, Horovod, Gloo, the store and heartbeats
    all ride the tunnel. While it trains, a TCP scan of each site's WAN address from the outsider, on
    every port a process of that site listens on, finds none open (the store, Gloo and sshd bind
    tunnel addresses), and a capture on site b's WAN
    link during the whole job holds only WireGuard's UDP (site to site and launcher to site)."""
    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    import sys

    import yaml

    from medseg.datasets.synthetic import make_seg_dataset
    from tests.conftest import tiny_seg_config

    root = Path(__file__).resolve().parents[2]
    data = make_seg_dataset(tmp_path / "seg", n_train=4, n_test=0, seed=5, size=32)
    cfg = tiny_seg_config(
        data, tmp_path / "runs", name="secure", epochs=8, batch_size=1, threads=1, scheduler="none"
    ).to_dict()
    cfg["dist"].update({"sync": "bsp", "timeout_s": 120})
    config = tmp_path / "secure.yaml"
    config.write_text(yaml.safe_dump(cfg))
    metrics = tmp_path / "runs" / "secure" / "metrics.jsonl"
    pcap = tmp_path / "job.pcap"
    scans = {}
    with sites.testbed(sites="a:1,b:1", wan="50mbit:5ms", probe=False, secure=True) as bed:
        env = bed.launcher_env()
        env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "180")
        argv = [str(Path(sys.executable).parent / "medseg"), "train", "--config", str(config)]
        argv += ["--np", "2", "--hosts", bed.hosts_arg()]
        with outsider.capture(
            ROUTER_NS, bed.site("b").router_dev, pcap, max_packets=400_000, max_seconds=420
        ):
            job = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root
            )
            try:
                deadline = time.monotonic() + 300
                while not (metrics.is_file() and metrics.stat().st_size) and job.poll() is None:
                    assert time.monotonic() < deadline, "no epoch finished in 300 s"
                    time.sleep(0.5)
                # the job is training: scan the ports its processes listen on (and the well-known ones)
                listening = {s.name: _listening_ports(s.netns) for s in bed.sites}
                with outsider.attacker() as atk:
                    scans = {
                        s.name: outsider.scan_tcp(atk, s.ip, [*listening[s.name], *range(1, 1025)])
                        for s in bed.sites
                    }
                still_training = job.poll() is None
                out, err = job.communicate(timeout=400)
            finally:
                if job.poll() is None:
                    job.kill()
                    job.wait()
        (tmp_path / "job.log").write_text(out + err)
        logs = {s.name: (s.dir / "sshd.log").read_text() for s in bed.sites}
        sshd = "".join(f"\n--- sshd at site {n}:\n{t[-1500:]}" for n, t in logs.items())
        assert job.returncode == 0, f"see {tmp_path / 'job.log'}: " + err[-3000:] + sshd
        counters = bed.wan_counters()
    assert still_training, "the job ended before the scan did: the scan saw no job sockets (more epochs)"
    assert len(listening["a"]) >= 3, listening  # sshd, rank 0's store, Gloo: the scan had targets
    for name, scan in scans.items():
        assert scan["open"] == [] and scan["filtered"] == [], (name, listening[name], scan["open"])
    for name, text in logs.items():
        assert "Accepted publickey for root from 198.19.255.254" in text, (name, text[-500:])
    assert counters["bytes"] > 100_000, counters  # gradients crossed the WAN, inside the tunnel
    flows = outsider.flows(outsider.pcap_packets(pcap))
    assert sum(flows.values()) > 100, flows
    scan = outsider.ATTACKER_IP  # the outsider's own scan packets are not the job's
    stray = {
        k: n
        for k, n in flows.items()
        if scan not in (k[1], k[3]) and not (k[0] == "udp" and WG_PORT in (k[2], k[4]))
    }
    assert not stray, stray
    assert leftovers() == []
