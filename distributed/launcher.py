"""Start a training job on several ranks under ``horovodrun`` and watch it until it ends.

``medseg train --config C --np N [--hosts h1:4,h2:4]`` re-executes itself as N workers through
Horovod's own launcher (Gloo controller; NCCL data path where Horovod was built with it). The parent
never trains: it watches the workers' heartbeat files (``<run>/ranks/rank-R.jsonl``, appended after
every step) and stops the whole job when

- a worker exits with an error: horovodrun ends the others; the first rank that failed is named;
- the job is stuck: no rank has completed a step for ``dist.timeout_s`` seconds. A dead or hung
  rank makes every other rank wait in its next collective, so the rank whose last heartbeat is the
  oldest is the one that stopped first, and it is named.

Either way the last checkpoint is intact (it is written atomically between epochs) and ``--resume``
continues from it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from medseg.config import Config
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


def _heartbeats(ranks_dir: Path, np_: int) -> dict[int, float]:
    beats = {}
    for r in range(np_):
        path = ranks_dir / f"rank-{r}.jsonl"
        if path.exists():
            beats[r] = path.stat().st_mtime
    return beats


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
    cmd = [
        horovodrun_path(),
        "-np",
        str(np_),
        "-H",
        parse_hosts(hosts, np_),
        "--gloo",
        "--start-timeout",
        "60",
    ]
    cmd += worker_command(config_path, overrides, resume, straggler)
    env = dict(os.environ, **{WORKER_ENV: "1", "PYTHONUNBUFFERED": "1"})
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning")  # N copies of library noise
    log.info("launching %d ranks: %s", np_, " ".join(cmd))
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
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
    started = time.time()
    hung: tuple[int, float] | None = None
    while proc.poll() is None:
        time.sleep(1.0)
        beats = _heartbeats(ranks_dir, np_)
        now = time.time()
        # Before every rank has beaten once (start-up, data caching), allow a longer grace period.
        limit = timeout if len(beats) == np_ else max(timeout, 600.0)
        newest = max(beats.values(), default=started)
        if now - max(newest, started) > limit:
            silent = {r: beats.get(r, started) for r in range(np_)}
            culprit = min(silent, key=lambda r: silent[r])
            hung = (culprit, now - silent[culprit])
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            break
    reader.join(timeout=5)
    resume_hint = f"continue with `medseg train --config {config_path} --np {np_} --resume`"
    if hung is not None:
        raise RunError(
            f"rank {hung[0]} stopped responding (no step for {hung[1]:.0f} s, dist.timeout_s={timeout:g}); "
            f"all ranks were stopped. {_checkpoint_note(last)}; {resume_hint}"
        )
    if proc.returncode != 0:
        if first_failure:
            rank, code = first_failure[0], first_failure[1] if len(first_failure) > 1 else None
            what = f"rank {rank} exited with status {code}" + (
                " (killed)" if code in (-9, 137, -15, 143) else ""
            )
        else:
            what = f"horovodrun exited with status {proc.returncode}"
        raise RunError(f"{what}; the other ranks were stopped. {_checkpoint_note(last)}; {resume_hint}")


def _checkpoint_note(last: Path) -> str:
    if not last.exists():
        return "no checkpoint was written yet"
    from medseg.checkpoint import load_checkpoint

    epoch = load_checkpoint(last)["epoch"]
    return f"the last checkpoint {last} (epoch {epoch}) is intact"


def is_worker() -> bool:
    """True inside a rank started by :func:`launch` (or by a user's own horovodrun line)."""
    return os.environ.get(WORKER_ENV) == "1" or "HOROVOD_RANK" in os.environ
