"""Liveness beats come from a helper process: a rank holding the GIL still beats, a stopped one does not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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
