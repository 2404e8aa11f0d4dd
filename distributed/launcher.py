"""Start a training job on several ranks under ``horovodrun`` and watch it until it ends.

``medseg train --config C --np N [--hosts h1:4,h2:4]`` re-executes itself as N workers through
Horovod's own launcher (Gloo controller; ssh to other hosts, as horovodrun does). The parent never
trains: it serves the heartbeat endpoint every rank connects to (:mod:`medseg.distributed.heartbeat`;
servers in different hospitals share no file system, so progress travels over the network), writes
what the ranks report to ``<run>/ranks/rank-R.jsonl``, and stops the whole job when

- a worker exits with an error: horovodrun ends the others; the first rank that failed is named;
- a rank goes silent for ``dist.timeout_s`` (dead, frozen, or its site cut off), or every rank is
  training but none has completed a step for ``dist.timeout_s``; the rank, its host and site are
  named. Loading data, validating and waiting for the chief are reported phases, never "hung".

Either way the last checkpoint is intact (it is written atomically between epochs) and ``--resume``
continues from it. Horovod's own stall shutdown is switched off (the watchdog decides), and
Horovod's Gloo timeout is raised to ``dist.timeout_s`` + 60 s so that a long collective is not
killed by Horovod's 30 s default before the watchdog has looked at it.

Environment the launcher reads: ``MEDSEG_BEAT_HOST`` (the address ranks use to reach this process;
default 127.0.0.1 for a single-host job, else this host's name), ``MEDSEG_HOROVODRUN_ARGS`` (extra
horovodrun arguments, e.g. ``--network-interfaces br0``, used by the site testbed).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from medseg.config import Config
from medseg.distributed.heartbeat import BEAT_ADDR_ENV, BeatServer, Watchdog, describe
from medseg.errors import ConfigError, RunError

log = logging.getLogger(__name__)
WORKER_ENV = "MEDSEG_WORKER"
# horovodrun (Gloo) reports the first failed rank as "Process name: R" then "Exit code: C".
_FAILED_RANK = re.compile(r"^Process name: (\d+)")
_EXIT_CODE = re.compile(r"^Exit code: (-?\d+)")


def parse_hosts(hosts: str | None, np_: int) -> str:
    """Validate ``h1:4,h2:4`` (slots per host) against ``--np``; default all ranks on localhost."""
    if not hosts:
        return f"localhost:{np_}"
    total = 0
    for item in hosts.split(","):
        name, _, slots = item.partition(":")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise ConfigError(f"--hosts: {item!r} is not HOST:SLOTS (e.g. gpu1:4,gpu2:4)")
        total += int(slots)
    if total < np_:
        raise ConfigError(f"--hosts: {hosts} offers {total} slots but --np asks for {np_}")
    return hosts


def horovodrun_path() -> str:
    beside = Path(sys.executable).parent / "horovodrun"
    found = str(beside) if beside.exists() else shutil.which("horovodrun")
    if not found:
        raise RunError("horovodrun not found: Horovod is not installed in this environment; run `make setup`")
    return found


def worker_command(config: Path, overrides: list[str], resume: bool, straggler: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "medseg", "train", "--config", str(config), "--no-progress"]
    if resume:
        cmd.append("--resume")
    if straggler:
        cmd += ["--straggler", straggler]
    return cmd + list(overrides)


def launch(
    cfg: Config,
    config_path: Path,
    overrides: list[str],
    np_: int,
    hosts: str | None,
    resume: bool,
    straggler: str | None,
) -> None:
    """Run the job on ``np_`` ranks; raise RunError naming the rank when one fails or hangs."""
    if np_ < 1:
        raise ConfigError("--np: needs at least 1 rank")
    if cfg.dist.sync == "none":
        raise ConfigError(
            "dist.sync: 'none' trains in one process; pick bsp, gssp, ssp or local-sgd for --np"
        )
    last = cfg.run_dir / "checkpoints" / "last.pt"
    if not resume and last.exists():
        raise RunError(
            f"{cfg.run_dir}: already holds a run; pass --resume to continue it, or name=<new name> to start another"
        )
    ranks_dir = cfg.run_dir / "ranks"
    shutil.rmtree(ranks_dir, ignore_errors=True)
    ranks_dir.mkdir(parents=True)
    timeout = cfg.dist.timeout_s
    hosts_arg = parse_hosts(hosts, np_)
    cmd = [horovodrun_path(), "-np", str(np_), "-H", hosts_arg, "--gloo", "--start-timeout", "60"]
    cmd += shlex.split(os.environ.get("MEDSEG_HOROVODRUN_ARGS", ""))
    cmd += worker_command(config_path, overrides, resume, straggler)
    beats = BeatServer(ranks_dir)
    single_host = hosts is None
    beat_host = os.environ.get("MEDSEG_BEAT_HOST") or ("127.0.0.1" if single_host else socket.getfqdn())
    env = dict(os.environ, **{WORKER_ENV: "1", "PYTHONUNBUFFERED": "1"})
    env[BEAT_ADDR_ENV] = f"{beat_host}:{beats.port}"
    env["MEDSEG_BEAT_TIMEOUT_S"] = str(int(timeout) + 30)  # a rank cut off from the launcher stops after this
    env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = "0"
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(timeout) + 60))
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning")  # N copies of library noise
    log.info("launching %d ranks: %s", np_, " ".join(cmd))
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    first_failure: list[int] = []  # [rank, exit code] of the first rank horovodrun saw fail

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            rank, code = _FAILED_RANK.match(line.strip()), _EXIT_CODE.match(line.strip())
            if rank and not first_failure:
                first_failure.append(int(rank.group(1)))
            elif code and len(first_failure) == 1:
                first_failure.append(int(code.group(1)))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    watchdog = Watchdog(np_, timeout)
    hung: str | None = None
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            hung = watchdog.verdict(beats.snapshot())
            if hung is not None:
                _stop(proc)
                break
    except BaseException:
        _stop(proc)
        raise
    finally:
        states = beats.snapshot()
        beats.close()
    reader.join(timeout=5)
    resume_hint = f"continue with `medseg train --config {config_path} --np {np_} --resume`"
    if hung is not None:
        raise RunError(
            f"{hung} (dist.timeout_s={timeout:g}); all ranks were stopped. {_checkpoint_note(last)}; {resume_hint}"
        )
    if proc.returncode != 0:
        if first_failure:
            rank, code = first_failure[0], first_failure[1] if len(first_failure) > 1 else None
            what = f"{describe(rank, states.get(rank))} exited with status {code}" + (
                " (killed)" if code in (-9, 137, -15, 143) else ""
            )
        else:
            what = f"horovodrun exited with status {proc.returncode}"
        raise RunError(f"{what}; the other ranks were stopped. {_checkpoint_note(last)}; {resume_hint}")


def _die_with_parent() -> None:
    """In horovodrun's process: get SIGTERM when the launcher dies, even by SIGKILL (Linux prctl).

    horovodrun's per-rank middlemen end their ranks when horovodrun goes, so no rank outlives a
    launcher that was killed (a CI timeout, an OOM kill).
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the launcher's own handlers still stop the job on SIGTERM/SIGINT
        pass


def _stop(proc: subprocess.Popen) -> None:
    """End horovodrun and every rank it started (its own process group), politely then not."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _checkpoint_note(last: Path) -> str:
    if not last.exists():
        return "no checkpoint was written yet"
    from medseg.checkpoint import load_checkpoint

    epoch = load_checkpoint(last)["epoch"]
    return f"the last checkpoint {last} (epoch {epoch}) is intact"


def is_worker() -> bool:
    """True inside a rank started by :func:`launch` (or by a user's own horovodrun line)."""
    return os.environ.get(WORKER_ENV) == "1" or "HOROVOD_RANK" in os.environ
