"""The emulated hospital network: real namespaces, real TCP through the shaped WAN, real sshd.

Everything but the spec parsing needs root, iproute2, util-linux and Debian's openssh-server
(``make sites-deps``); without them the tests skip with the reason. Each test makes its own
testbed and the ``testbed`` context manager removes it, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from medseg.distributed.testbed import testbed as sites  # not its names: pytest would collect them
from medseg.distributed.testbed.cgroups import CFS_PERIOD_US
from medseg.distributed.testbed.host import check_host
from medseg.distributed.testbed.netns import our_namespaces
from medseg.distributed.testbed.probe import tcp_connect_error, tcp_connects, tcp_throughput
from medseg.distributed.testbed.spec import (
    Network,
    SitesError,
    WanSpec,
    dilate,
    parse_cpu,
    parse_network,
    parse_sites,
    parse_wan,
)
from medseg.distributed.testbed.sweep import leftovers
from tests.conftest import tiny_seg_config

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _host_problem() -> str | None:
    try:
        check_host(cpu=True)
    except SitesError as exc:
        return str(exc)
    return None


needs_host = pytest.mark.skipif(
    _host_problem() is not None, reason=f"no sites testbed here: {_host_problem()}"
)


def _start_job(tb: sites.Testbed, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``medseg train ...`` launched the way the testbed's launcher runs it, output captured."""
    return subprocess.Popen(
        tb.launcher_prefix() + argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_specs_parse_and_name_what_is_wrong() -> None:
    assert parse_wan("20mbit:25ms") == WanSpec(20_000_000, 25.0, 0.0)
    assert parse_wan("1gbit:500us:0.1%") == WanSpec(10**9, 0.5, 0.001)
    assert parse_wan("none") == WanSpec(None, 0.0, 0.0)
    assert str(parse_wan("20mbit:25ms:1%")) == "20mbit:25ms:1%"
    assert parse_sites("a:2,b:1") == {"a": 2, "b": 1}
    assert parse_cpu("a=0.5", {"a": 2, "b": 1}) == {"a": 0.5}
    for bad, where in (
        ("20mbit", "RATE:DELAY"),
        ("20mbps2:1ms", "rate"),
        ("20mbit:25", "delay"),
        ("1mbit:1ms:5", "loss"),
    ):
        with pytest.raises(SitesError, match=where):
            parse_wan(bad)
    with pytest.raises(SitesError, match="NAME:RANKS"):
        parse_sites("a2")
    with pytest.raises(SitesError, match="named twice"):
        parse_sites("a:1,a:1")
    with pytest.raises(SitesError, match="not one of the sites"):
        parse_cpu("c=1", {"a": 1})


def _tcp_packet(seq: int, payload: int, sport: int = 40000, options: int = 12) -> bytes:
    """An IPv4 + TCP packet (site a -> site b) with ``payload`` bytes and ``options`` bytes of TCP options."""
    import struct

    thl = 20 + options
    total = 20 + thl + payload
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, total, 0, 0, 64, 6, 0, bytes([198, 18, 1, 1]), bytes([198, 18, 2, 1])
    )
    tcp = struct.pack("!HHIIBBHHH", sport, 5000, seq, 0, (thl // 4) << 4, 0x10, 65535, 0, 0)
    return ip + tcp + b"\x01" * options + b"x" * payload


def test_relay_counts_headers_payload_and_retransmissions() -> None:
    from medseg.distributed.testbed.relay import Counters

    c = Counters()
    c.inspect(_tcp_packet(1000, 1448))  # new
    c.inspect(_tcp_packet(2448, 1448))  # new
    c.inspect(_tcp_packet(1000, 1448))  # the first one again: a retransmission
    c.inspect(_tcp_packet(3000, 1448))  # 896 bytes already sent, 552 new
    c.inspect(_tcp_packet(0, 0))  # a pure ACK
    c.inspect(_tcp_packet(2**32 - 100, 300, sport=40001))  # another flow, wrapping around 2**32
    c.inspect(_tcp_packet(200, 100, sport=40001))  # new after the wrap
    c.inspect(_tcp_packet(2**32 - 50, 100, sport=40001))  # old data from before the wrap
    t = c.tcp
    assert t["payload"] == 4 * 1448 + 300 + 100 + 100
    assert t["headers"] == 8 * 52
    assert t["retrans_payload"] == 1448 + 896 + 100 and t["retrans_packets"] == 3
    assert t["pure_acks"] == 1 and t["other"] == 0
    c.inspect(b"\x45" + b"\x00" * 8 + b"\x11" + b"\x00" * 18)  # UDP: not TCP, counted apart
    assert c.tcp["other"] == 28


def test_without_root_or_tools_the_cli_says_what_to_do(monkeypatch, capsys) -> None:
    from medseg.cli.main import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["sites", "up", "--sites", "a:1,b:1", "--wan", "20mbit:25ms"]) == 2
    assert "error: the sites testbed needs root" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "unshare" else "/usr/bin/" + tool)
    with pytest.raises(SitesError, match="needs unshare.*make sites-deps"):
        check_host()
    assert main(["sites", "up", "--sites", "a:1,b:1", "--wan", "20mbit"]) == 2
    assert "RATE:DELAY" in capsys.readouterr().err


@needs_host
def test_a_failure_in_the_middle_of_up_leaves_nothing(monkeypatch) -> None:
    def broken_sshd(self, site):
        raise SitesError(f"sshd of {site.hostname} broke on purpose")

    monkeypatch.setattr(sites.Testbed, "_start_sshd", broken_sshd)
    with pytest.raises(SitesError, match="broke on purpose"):
        sites.Testbed.up("a:1,b:1", "20mbit:25ms", "a=0.5", probe=False)
    assert leftovers() == []


@needs_host
def test_up_probe_and_down_leaves_nothing() -> None:
    with sites.testbed(sites="a:1,b:1", wan="20mbit:25ms", cpu="a=0.5", probe=False) as tb:
        report = tb.probe(check=True)
        assert report["ok"], report
        assert abs(report["rtt_ms"] - 50.0) <= 5.0
        assert 18.0 <= report["mbit_s"] <= 22.0
        # The probe really compares: the same link checked against a wrong spec must fail.
        tb.wan = Network(WanSpec(40_000_000, 10.0, 0.0))
        with pytest.raises(SitesError, match="does not measure as specified"):
            tb.probe(check=True, seconds=1.5)
        tb.wan = Network(WanSpec(20_000_000, 25.0, 0.0))
        # Each site is a host: its own hostname, names of all sites, no route out, its CPU quota.
        out = tb.exec_in(
            "a", ["sh", "-c", "hostname; getent hosts site-b; ip -4 route; cat /proc/self/cgroup"]
        )
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == "site-a"
        assert lines[1].split() == ["198.18.2.1", "site-b"]
        assert "default" not in out.stdout and "198.18.0.0/15 via 198.18.1.254" in out.stdout
        assert any(line.endswith(":/medseg-sites/a") for line in lines if ":cpu" in line)
        cg = Path("/sys/fs/cgroup/cpu/medseg-sites")
        assert int((cg / "a" / "cpu.cfs_quota_us").read_text()) == CFS_PERIOD_US // 2
        assert int((cg / "b" / "cpu.cfs_quota_us").read_text()) == -1
        counters = tb.wan_counters()
        assert counters["bytes"] > 5_000_000  # the probe's flow crossed the WAN relay
        assert set(tb.status()["sites"][0]) >= {"ip", "hostname", "sshd_alive"}
        assert all(s["sshd_alive"] for s in tb.status()["sites"])
    assert leftovers() == []


@needs_host
def test_probe_measures_an_unshaped_link_that_sends_everything_within_the_warmup() -> None:
    # 16 MB over a veth takes milliseconds, far less than the probe's 0.5 s slow-start warm-up
    with sites.testbed(sites="a:1,b:1", wan="none", probe=False) as tb:
        flow = tcp_throughput(tb.site("a"), tb.site("b"), seconds=3.0, max_bytes=16 << 20)
        assert flow["bytes"] == 16 << 20
        assert flow["mbit_s"] > 100 and 0 < flow["seconds"] < 3.0
    assert leftovers() == []


@needs_host
def test_cut_stops_traffic_and_restore_brings_it_back() -> None:
    with sites.testbed(sites="a:1,b:1", wan="20mbit:5ms", probe=False) as tb:
        a, b = tb.site("a"), tb.site("b")
        assert tcp_connects(a, b)
        tb.cut("b")
        assert tb.status()["sites"][1]["link_up"] is False
        error = tcp_connect_error(a, b, timeout=2.0)
        # dropped (a timeout) or answered by the router as unreachable; never refused by site b itself
        assert error is not None and not isinstance(error, ConnectionRefusedError), error
        tb.restore("b")
        assert tcp_connects(a, b, timeout=5.0)
    assert leftovers() == []


@needs_host
def test_relay_is_bounded_and_a_dead_relay_blackholes_the_wan() -> None:
    with sites.testbed(sites="a:1,b:1", wan="20mbit:5ms", probe=False, lifetime_s=3.0) as tb:
        a, b = tb.site("a"), tb.site("b")
        relay = tb.state["pids"]["relay"]
        assert tcp_connects(a, b)
        _, status = os.waitpid(relay, 0)  # our child: it must end by itself after its lifetime
        assert os.waitstatus_to_exitcode(status) == 0
        assert time.time() - tb.state["created"] < 15
        # Without the relay, inter-site packets are dropped, never forwarded undelayed.
        assert not tcp_connects(a, b, timeout=1.0)
        assert tb.status()["relay_alive"] is False
    with sites.testbed(sites="a:1,b:1", wan="20mbit:5ms", probe=False) as tb:
        relay = tb.state["pids"]["relay"]
        os.kill(relay, signal.SIGTERM)
        t0 = time.monotonic()
        _, status = os.waitpid(relay, 0)
        assert os.waitstatus_to_exitcode(status) == 0 and time.monotonic() - t0 < 2.0
    assert leftovers() == []


@needs_host
def test_up_replaces_a_crashed_testbed_and_refuses_a_live_one() -> None:
    crashed = sites.Testbed.up("a:1,b:1", "none", probe=False, owned=False)  # as if its maker had died
    _run_ok(["ip", "netns", "add", "msite-junk"])  # and a half-made extra from a failed `up`
    with sites.testbed(sites="x:1,y:1", wan="none", probe=False) as tb:
        assert sorted(n for n in our_namespaces()) == ["msite-router", "msite-x", "msite-y"]
        assert tcp_connects(tb.site("x"), tb.site("y"))
        holder = subprocess.Popen(["sleep", "30"])
        try:
            tb.state["owner_pid"] = holder.pid  # a testbed owned by another live process
            tb._save()
            with pytest.raises(SitesError, match=f"process {holder.pid}"):
                sites.Testbed.up("z:1", "none", probe=False)
        finally:
            holder.kill()
            holder.wait()
    assert crashed.site_ip("a") == "198.18.1.1"  # its namespaces were swept above
    assert leftovers() == []


def _run_ok(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@needs_host
def test_horovod_job_runs_through_ssh_in_both_sites(tmp_path: Path) -> None:
    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    from medseg.datasets.synthetic import make_seg_dataset

    data = make_seg_dataset(tmp_path / "seg", n_train=8, n_test=0, seed=5, size=32)
    cfg = tiny_seg_config(
        data, tmp_path / "runs", name="sites", epochs=2, batch_size=1, threads=1, scheduler="none"
    ).to_dict()
    cfg["dist"].update({"sync": "bsp", "timeout_s": 120})
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump(cfg))
    with sites.testbed(sites="a:2,b:2", wan="50mbit:5ms", probe=False) as tb:
        env = tb.launcher_env()
        env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "180")  # 4 ranks importing torch on 2 busy cores
        argv = [str(BIN / "medseg"), "train", "--config", str(config), "--np", "4", "--hosts", tb.hosts_arg()]
        proc = subprocess.run(
            tb.launcher_prefix() + argv, env=env, capture_output=True, text=True, timeout=420, cwd=ROOT
        )
        (tmp_path / "job.log").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, (
            f"see {tmp_path / 'job.log'}: " + proc.stdout[-3000:] + proc.stderr[-3000:]
        )
        counters = tb.wan_counters()
        logs = {s.name: (s.dir / "sshd.log").read_text() for s in tb.sites}
    runs = list((tmp_path / "runs").iterdir())
    assert [r.name for r in runs] == ["sites"]
    assert (runs[0] / "metrics.jsonl").stat().st_size > 0
    assert (runs[0] / "bundle").is_dir()
    # Ranks really ran in both sites: each sshd took the launcher's key, and gradients crossed the WAN.
    for name, text in logs.items():
        assert "Accepted publickey for root from 198.18.0.1" in text, (
            f"no ssh login at site {name}: {text[-500:]}"
        )
    assert counters["bytes"] > 100_000, counters
    assert all(link["sent_bytes"] > 0 for link in counters["links"].values()), counters
    assert leftovers() == []


@needs_host
def test_a_cut_site_stops_the_job_naming_it_and_resume_continues(tmp_path: Path) -> None:
    """Site b's link is cut mid-run: within dist.timeout_s (+ slack) the launcher stops the job, names
    the rank and its site, exits 2 with the checkpoint intact; with the link back, --resume continues."""
    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    from medseg.checkpoint import load_checkpoint
    from medseg.datasets.synthetic import make_seg_dataset
    from medseg.training.runlog import read_metrics

    data = make_seg_dataset(tmp_path / "seg", n_train=8, n_test=0, seed=5, size=32)
    cfg = tiny_seg_config(
        data, tmp_path / "runs", name="cut", epochs=40, batch_size=1, threads=1, scheduler="none"
    ).to_dict()
    cfg["dist"].update({"sync": "gssp", "staleness": 1, "timeout_s": 20, "profile_steps": 2})
    config = tmp_path / "cut.yaml"
    config.write_text(yaml.safe_dump(cfg))
    last = tmp_path / "runs" / "cut" / "checkpoints" / "last.pt"
    with sites.testbed(sites="a:1,b:1", wan="50mbit:5ms", probe=False) as tb:
        env = tb.launcher_env()
        argv = [str(BIN / "medseg"), "train", "--config", str(config), "--np", "2", "--hosts", tb.hosts_arg()]
        job = _start_job(tb, argv, env)
        try:
            deadline = time.time() + 300
            while not last.exists():
                assert job.poll() is None and time.time() < deadline, "no checkpoint appeared"
                time.sleep(0.5)
            tb.cut("b")
            tic = time.time()
            out, err = job.communicate(timeout=180)
            took = time.time() - tic
        finally:
            if job.poll() is None:
                job.kill()
        (tmp_path / "job.log").write_text(out + err)
        assert job.returncode == 2, err[-3000:]
        message = err.split("error:")[-1]
        assert "rank 1" in message and "site-b" in message and "Traceback" not in message, message
        assert took < 20 + 60, took
        time.sleep(10)  # site a's rank notices the launcher is gone and stops (it must not train on)
        epoch = load_checkpoint(last)["epoch"]
        tb.restore("b")
        proc = subprocess.run(
            tb.launcher_prefix() + argv + ["--resume", f"train.epochs={epoch + 1}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert read_metrics(tmp_path / "runs" / "cut" / "metrics.jsonl")[-1]["epoch"] == epoch + 1
    assert leftovers() == []


def _two_hospitals(tmp_path: Path, name: str, epochs: int) -> tuple[Path, Path]:
    """A gssp job config for sites a and b (one rank each), each with its own 6 cases; returns the
    config file and the run folder."""
    from medseg.datasets.synthetic import make_seg_dataset

    dirs = {
        s: make_seg_dataset(tmp_path / s, n_train=6, n_test=0, seed=i, size=32) for i, s in enumerate("ab")
    }
    cfg = tiny_seg_config(
        tmp_path / "unused",
        tmp_path / "runs",
        name=name,
        epochs=epochs,
        batch_size=1,
        threads=1,
        scheduler="none",
    ).to_dict()
    cfg["dist"].update({"sync": "gssp", "staleness": 1, "timeout_s": 15, "profile_steps": 2})
    cfg["sites"] = {s: {"dir": str(d), "host": f"198.18.{i + 1}.1"} for i, (s, d) in enumerate(dirs.items())}
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config, tmp_path / "runs" / name


def _start_with_restarts(
    tb: sites.Testbed, config: Path, run: Path, restarts: int
) -> tuple[subprocess.Popen, float]:
    """Launch the two-hospital job with ``--max-restarts restarts --min-sites 1`` and wait for its
    first checkpoint; returns the job and the deadline (15 min) for the rest of the test."""
    argv = [str(BIN / "medseg"), "train", "--config", str(config), "--np", "2", "--hosts", "a:1,b:1"]
    argv += ["--max-restarts", str(restarts), "--min-sites", "1"]
    job = _start_job(tb, argv, tb.launcher_env())
    deadline = time.time() + 900
    try:
        while not (run / "checkpoints" / "last.pt").exists():
            assert job.poll() is None and time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.5)
    except BaseException:
        job.kill()
        job.wait()
        raise
    return job, deadline


def _site_ranks(tb: sites.Testbed, name: str) -> list[int]:
    """PIDs of the training processes started in a site (read from its CPU cgroup and /proc)."""
    out = []
    for line in (tb.site(name).cgroup / "cgroup.procs").read_text().split():
        try:
            cmd = Path(f"/proc/{line}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"medseg" in cmd and b"train" in cmd:
            out.append(int(line))
    return out


@needs_host
def test_a_site_cut_mid_epoch_is_left_out_and_the_job_finishes_with_the_others(tmp_path: Path) -> None:
    """Two hospitals, each with its own data; site b's link is cut after the first checkpoint. With
    --max-restarts 1 the launcher names site b, restarts from the last checkpoint with site a
    alone and the job finishes every epoch: the work lost is at most the epoch that was running."""
    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    from medseg.checkpoint import load_checkpoint
    from medseg.training.runlog import read_metrics

    config, run = _two_hospitals(tmp_path, "drop", epochs=8)
    with sites.testbed(sites="a:1,b:1", wan="50mbit:5ms", probe=False) as tb:
        job, deadline = _start_with_restarts(tb, config, run, restarts=1)
        try:
            done_at_cut = load_checkpoint(run / "checkpoints" / "last.pt")["epoch"]
            tb.cut("b")
            out, err = job.communicate(timeout=500)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    (tmp_path / "job.log").write_text(out + err)
    assert job.returncode == 0, err[-3000:]
    assert "site b dropped out" in err and "restart 1 of 1" in err and "with sites a" in err, err[-3000:]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["epoch"] for r in records] == list(range(1, 9))
    resumed = min(r["epoch"] for r in records if set(r["sites"]) == {"a"})
    assert resumed - 1 >= done_at_cut, (
        resumed,
        done_at_cut,
    )  # restarted from the checkpoint there at the cut (or later)
    assert all(set(r["sites"]) == {"a", "b"} for r in records if r["epoch"] < resumed)
    assert (run / "bundle").is_dir()
    assert leftovers() == []


@needs_host
def test_a_dropped_site_that_answers_again_rejoins_at_the_next_restart(tmp_path: Path) -> None:
    """Site b's link is cut: restart 1 goes on with site a alone. b's link comes back; then site a's
    ranks are killed. Restart 2 takes b back (its ssh port answers again) and leaves a out, and the
    job finishes every epoch with site b."""
    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    from medseg.training.runlog import read_metrics

    config, run = _two_hospitals(tmp_path, "rejoin", epochs=14)
    metrics = run / "metrics.jsonl"

    def sites_trained() -> list[set[str]]:
        return [set(r["sites"]) for r in read_metrics(metrics)] if metrics.is_file() else []

    with sites.testbed(sites="a:1,b:1", wan="50mbit:5ms", probe=False) as tb:
        job, deadline = _start_with_restarts(tb, config, run, restarts=2)
        try:
            tb.cut("b")
            while {"a"} not in sites_trained():  # restart 1: an epoch with site a alone
                assert job.poll() is None and time.time() < deadline, "no epoch of site a alone"
                time.sleep(0.5)
            tb.restore("b")
            ranks = _site_ranks(tb, "a")
            assert ranks, "no training process found in site a's cgroup"
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
            out, err = job.communicate(timeout=500)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    (tmp_path / "job.log").write_text(out + err)
    assert job.returncode == 0, err[-3000:]
    assert "restart 2 of 2" in err and "with sites b (back: b)" in err, err[-3000:]
    trained = sites_trained()
    assert [r["epoch"] for r in read_metrics(metrics)] == list(range(1, 15))
    assert trained[-1] == {"b"} and {"a"} in trained, trained  # b alone at the end: it came back
    assert (run / "bundle").is_dir()
    assert leftovers() == []


@needs_host
def test_the_launcher_starts_ranks_only_on_hosts_whose_key_it_knows(tmp_path: Path) -> None:
    """horovodrun's ssh (through medseg's launcher, distributed/launch/hvdrun.py) checks host keys:
    with the site's real key in known_hosts the rank starts; with another key in its place the
    launch is refused and the site's sshd never sees the launcher log in."""
    from medseg.distributed.launch.launcher import horovodrun_command
    from medseg.distributed.testbed.ssh import KNOWN_HOSTS

    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    with sites.testbed(sites="a:1,b:1", wan="none", probe=False) as tb:
        b = tb.site("b")
        argv = [*horovodrun_command(), "-np", "1", "-H", f"{b.job_ip}:1", "--gloo"]
        argv += shlex.split(tb.launcher_env()["MEDSEG_HOROVODRUN_ARGS"]) + ["hostname"]
        known = subprocess.run(argv, env=tb.launcher_env(), capture_output=True, text=True, timeout=120)
        assert known.returncode == 0 and "site-b" in known.stdout, known.stdout[-2000:] + known.stderr[-2000:]
        logins = (b.dir / "sshd.log").read_text().count("Accepted publickey")
        other = tmp_path / "other_key"
        _run_ok(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)])
        forged = " ".join(Path(f"{other}.pub").read_text().split()[:2])
        KNOWN_HOSTS.write_text(
            "".join(
                f"{line.split()[0]} {forged}\n" if line.startswith(f"{b.job_ip},") else f"{line}\n"
                for line in KNOWN_HOSTS.read_text().splitlines()
            )
        )
        unknown = subprocess.run(argv, env=tb.launcher_env(), capture_output=True, text=True, timeout=120)
        out = unknown.stdout + unknown.stderr
        assert unknown.returncode != 0 and "site-b" not in unknown.stdout, out[-2000:]
        assert "host key" in out.lower(), out[-2000:]
        assert (b.dir / "sshd.log").read_text().count("Accepted publickey") == logins
    assert leftovers() == []


def test_one_link_per_site_makes_each_path_of_both_links_and_dilation_scales_them() -> None:
    net = parse_network("a=100mbit:5ms,b=20mbit:25ms,c=10mbit:40ms:1%", ["a", "b", "c"])
    assert str(net) == "a=100mbit:5ms,b=20mbit:25ms,c=10mbit:40ms:1%"
    assert net.path("a", "b") == WanSpec(20_000_000, 30.0, 0.0)
    c_to_b = net.path("c", "b")
    assert (c_to_b.rate_bit, c_to_b.delay_ms) == (10_000_000, 65.0) and c_to_b.loss == pytest.approx(0.01)
    assert net.needs_relay and Network.from_state(net.as_state()) == net
    assert parse_network("20mbit:25ms", ["a", "b"]).path("a", "b") == WanSpec(20_000_000, 25.0, 0.0)
    for bad in ("a=20mbit:25ms", "a=20mbit:25ms,b=1mbit:5ms,b=1mbit:5ms", "a=20mbit:25ms,x=1mbit:5ms"):
        with pytest.raises(SitesError, match="name every site once"):
            parse_network(bad, ["a", "b"])
    assert dilate(WanSpec(20_000_000, 25.0, 0.001), 10) == WanSpec(2_000_000, 250.0, 0.001)
    with pytest.raises(SitesError, match="> 0"):
        dilate(WanSpec(20_000_000, 25.0, 0.0), 0)


def test_the_relay_holds_a_packet_for_both_of_its_sites_links() -> None:
    from medseg.distributed.testbed.relay import Links

    def packet(src: int, dst: int) -> bytes:
        return bytes([0x45]) + bytes(11) + bytes([198, 18, src, 1, 198, 18, dst, 1]) + bytes(20)

    links = Links(0.0, 0.0, {1: (5.0, 0.0), 2: (25.0, 0.1), 3: (40.0, 0.0)})
    assert links.path(packet(1, 2)) == pytest.approx((0.030, 0.1))
    assert links.path(packet(3, 1)) == pytest.approx((0.045, 0.0))
    assert Links(25.0, 0.0).path(packet(1, 2)) == pytest.approx((0.025, 0.0))  # one spec for every path


@needs_host
def test_unequal_links_measure_as_specified_between_every_pair() -> None:
    """Three sites, each with its own link: every pair's RTT is twice the sum of its two links'
    delays and its rate the slower link's, within the probe's 10 % (its check raises otherwise)."""
    with sites.testbed(
        sites="a:1,b:1,c:1", wan="a=100mbit:5ms,b=20mbit:25ms,c=10mbit:40ms", probe=False
    ) as tb:
        pairs = tb.probe_pairs(check=True, seconds=2.0)
    expected = {"a-b": (60, 20), "a-c": (90, 10), "b-c": (130, 10)}
    assert set(pairs) == set(expected)
    for pair, (rtt, mbit) in expected.items():
        assert abs(pairs[pair]["rtt_ms"] - rtt) <= 0.1 * rtt, (pair, pairs[pair])
        assert 0.85 * mbit <= pairs[pair]["mbit_s"] <= 1.05 * mbit, (pair, pairs[pair])
    assert leftovers() == []
