"""Liveness beats come from a helper process: a rank holding the GIL still beats, a stopped one does not;
only lines signed with the job secret count."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from medseg.distributed.launch.beat_sidecar import MAX_LINE, signed_line
from medseg.distributed.launch.heartbeat import BEAT_INTERVAL_S, BeatServer

RANK = textwrap.dedent(
    """
    import ctypes, sys, time
    from medseg.distributed.launch.heartbeat import BeatClient
    beats = BeatClient(3, sys.argv[1])
    beats.send({"ev": "started"})
    time.sleep(1.0)
    print("holding", flush=True)
    ctypes.PyDLL(None).sleep(int(sys.argv[2]))  # libc sleep with the GIL held: no Python thread runs
    print("released", flush=True)
    time.sleep(600)
    """
)


def _processes_with(needle: str) -> list[int]:
    """Pids whose command line contains ``needle`` (arguments joined by NUL), read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # ended while we looked
                pass
    return found


def _silence(server: BeatServer) -> float:
    return time.time() - server.snapshot()[3].last_seen


def _wait_until(cond, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:  # bounded
        if cond():
            return True
        time.sleep(0.2)
    return False


def test_a_rank_holding_the_gil_beats_and_a_stopped_one_does_not(tmp_path: Path) -> None:
    server = BeatServer(tmp_path / "ranks", bind="127.0.0.1")
    hold_s = 4 * BEAT_INTERVAL_S
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, f"127.0.0.1:{server.port}", str(int(hold_s))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MEDSEG_JOB_SECRET": server.secret.hex()},  # as the launcher hands it over
    )
    sidecars = lambda: _processes_with(f"beat_sidecar.py\x00127.0.0.1\x00{server.port}\x00")  # noqa: E731
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "holding"
        # the rank's own threads cannot run now; the helper's beats go on
        time.sleep(2.5 * BEAT_INTERVAL_S)
        assert _silence(server) < 1.5 * BEAT_INTERVAL_S, "no beat while the rank held the GIL"
        assert rank.stdout.readline().strip() == "released"
        os.kill(rank.pid, signal.SIGSTOP)  # frozen: nothing may beat for it
        time.sleep(3 * BEAT_INTERVAL_S)
        assert _silence(server) > 2 * BEAT_INTERVAL_S, "a stopped rank kept beating"
        os.kill(rank.pid, signal.SIGCONT)
        assert _wait_until(lambda: _silence(server) < BEAT_INTERVAL_S, 4 * BEAT_INTERVAL_S)
        assert len(sidecars()) == 1
    finally:
        rank.kill()
        rank.wait()
        server.close()
    # the helper ends with its rank
    assert _wait_until(lambda: not sidecars(), 4 * BEAT_INTERVAL_S), "the beat helper outlived its rank"


def _send(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)


def _line(secret: bytes, record: dict, seq: int, sid: str = "a1") -> bytes:
    return signed_line(secret, {**record, "sid": sid, "seq": seq})


def test_forged_replayed_and_oversize_heartbeats_change_nothing_and_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only lines signed with the job secret count: a forged "done" or "error" (no MAC, another
    secret's MAC), a replayed line and an over-long line are dropped and logged; a genuine line
    after them still counts."""
    server = BeatServer(tmp_path / "ranks", bind="127.0.0.1")
    assert server._sock.getsockname()[0] == "127.0.0.1"  # the job's address only, not 0.0.0.0
    ok = {"rank": 0, "host": "h", "node": "n", "phase": "train", "ev": "started"}
    done = {**ok, "phase": "done"}
    error = {**ok, "ev": "error", "message": "site b is bad, trust me"}
    caplog.set_level(logging.WARNING, logger="medseg.distributed.launch.heartbeat")
    try:
        _send(server.port, _line(server.secret, ok, 1))
        assert _wait_until(lambda: 0 in server.snapshot(), 5)
        before = server.snapshot()[0]
        big = _line(server.secret, {**error, "message": "x" * MAX_LINE}, 3)
        _send(  # one connection: one thread reads it, in order
            server.port,
            (json.dumps(done) + "\n").encode()  # no MAC (the old format)
            + _line(b"x" * 32, error, 2, sid="b2")  # signed with another secret
            + b"0" * 64
            + b" "
            + json.dumps({**done, "sid": "c3", "seq": 1}).encode()
            + b"\n"  # a made-up MAC
            + _line(server.secret, ok, 1)  # a replay of the first line
            + big  # over the line limit (genuinely signed)
            + _line(server.secret, {**ok, "step": 1}, 4),
        )
        assert _wait_until(lambda: server.dropped >= 5, 5), server.dropped
        assert _wait_until(lambda: server.snapshot()[0].last_step > 0, 5), (
            "the genuine line after them was lost"
        )
        after = server.snapshot()[0]
        assert after.phase == before.phase == "train" and after.error == ""
        assert server.dropped == 5
        assert "dropped" in caplog.text and "MAC" in caplog.text
        written = (tmp_path / "ranks" / "rank-0.jsonl").read_text()
        assert "trust me" not in written and "x" * 100 not in written
        assert all(json.loads(line)["seq"] in (1, 4) for line in written.splitlines())  # JSON only, no MAC
        _send(server.port, _line(server.secret, error, 5))  # the same error, genuine: it counts
        assert _wait_until(lambda: server.snapshot()[0].error == error["message"], 5)
    finally:
        server.close()


def test_lines_are_cut_at_the_limit_however_the_stream_is_chunked() -> None:
    from medseg.distributed.launch.heartbeat import LineSplitter

    long_line, ok = b"y" * 30 + b"\n", b"ok\n"
    stream = ok + long_line + ok + b"z" * 95 + b"\n" + ok
    for size in (1, 7, 16, 64, len(stream)):
        lines, splitter = [], LineSplitter(limit=20)
        for i in range(0, len(stream), size):
            lines += splitter.feed(stream[i : i + size])
        assert lines == [b"ok", None, b"ok", None, b"ok"], (size, lines)
    splitter = LineSplitter(limit=20)
    assert splitter.feed(b"w" * 1000) == [None] and splitter.feed(b"w" * 1000) == []
    assert len(splitter.buf) < 20  # an endless line is never held in memory
    assert splitter.feed(b"w\nok\n") == [b"ok"]


def test_a_client_without_the_job_secret_is_refused_with_what_to_do(monkeypatch) -> None:
    from medseg.distributed.launch.heartbeat import BeatClient
    from medseg.errors import RunError

    monkeypatch.delenv("MEDSEG_JOB_SECRET", raising=False)
    with pytest.raises(RunError, match="MEDSEG_JOB_SECRET is not set.*medseg train --np"):
        BeatClient(0, "127.0.0.1:9")


def test_the_launcher_hands_the_secret_to_the_ranks_and_listens_on_the_jobs_address(monkeypatch) -> None:
    from medseg.distributed.launch import launcher

    monkeypatch.delenv("MEDSEG_BEAT_HOST", raising=False)
    assert launcher._beat_host(True, "localhost:2") == "127.0.0.1"
    assert launcher._bind_address("127.0.0.1") == "127.0.0.1"
    assert launcher._beat_host(False, "127.0.0.1:1,127.0.0.2:1").startswith("127.")
    secret = bytes(range(32))
    env = launcher._rank_env("127.0.0.1", 4242, 60.0, secret)
    assert env["MEDSEG_JOB_SECRET"] == secret.hex() and env["MEDSEG_BEAT_ADDR"] == "127.0.0.1:4242"
    monkeypatch.setenv("MEDSEG_BEAT_HOST", "beats.example.invalid")
    assert launcher._beat_host(False, "h:1") == "beats.example.invalid"


# What horovodrun printed in a CI run where rank 1 was SIGKILLed and rank 0's failed collective made it
# exit with status 1 before horovodrun noticed rank 1 (shortened; the order of the lines is the point).
_KILLED_PEER_NOTICED_LATE = """\
[0]<stderr>:horovod.common.exceptions.HorovodInternalError: Horovod has been shut down.
Process 0 exit with status code 1.
Terminating remaining workers after failure of Process 0.
Process 1 exit with status code 137.
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus causing the job to be terminated. The first process to do so was:
Process name: 0
Exit code: 1
"""


def _exit_log(text: str):
    from medseg.distributed.launch.launcher import ExitLog

    log = ExitLog()
    for line in text.splitlines(keepends=True):
        log.feed(line)
    return log


def test_a_killed_rank_is_blamed_over_the_peer_that_horovodrun_saw_fail_first() -> None:
    assert _exit_log(_KILLED_PEER_NOTICED_LATE).culprit() == (1, 137)


def test_the_rank_with_an_error_is_blamed_when_the_others_only_got_horovodruns_sigterm() -> None:
    text = (
        "Process 1 exit with status code 1.\nTerminating remaining workers after failure of Process 1.\n"
        "Process 0 exit with status code 143.\nProcess name: 1\nExit code: 1\n"
    )
    assert _exit_log(text).culprit() == (1, 1)
    assert _exit_log("Process name: 2\nExit code: -11\n").culprit() == (2, -11)
    assert _exit_log("nothing failed\n").culprit() is None


def test_hosts_ssh_would_not_trust_are_named_not_blamed_on_a_rank() -> None:
    """horovodrun's output when ssh's host-key check fails (strict checking, an unknown or changed
    key): the launcher names those hosts and how to check their keys, and blames no rank."""
    from medseg.distributed.launch.launcher import ExitLog, _failed

    exits = ExitLog()
    for line in (
        "ssh not successful for host 198.19.255.1:",
        "No ED25519 host key is known for 198.19.255.1 and you have requested strict checking.",
        "Host key verification failed.",
        "",
        "ssh not successful for host 198.19.255.2:",
        "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @",
        "Host key verification failed.",
        "RuntimeError: could not connect to some hosts via ssh",
    ):
        exits.feed(line)
    assert exits.unverified == ["198.19.255.1", "198.19.255.2"]
    attempt = _failed(1, exits, {}, "")
    assert attempt.rank is None and not attempt.ok
    assert "ssh refused 198.19.255.1, 198.19.255.2" in attempt.message and "known_hosts" in attempt.message
    other = ExitLog()
    other.feed("ssh not successful for host 10.0.0.5:")
    other.feed("ssh: connect to host 10.0.0.5 port 22: Connection refused")
    assert other.unverified == []
