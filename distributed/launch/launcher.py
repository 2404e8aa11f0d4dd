"""Start a training job on several ranks under ``horovodrun`` and watch it until it ends.

``medseg train --config C --np N [--hosts h1:4,h2:4]`` re-executes itself as N workers through
Horovod's own launcher (Gloo controller; ssh to other hosts, as horovodrun does). The parent never
trains: it serves the heartbeat endpoint every rank connects to (:mod:`medseg.distributed.launch.heartbeat`;
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

Every attempt gets a fresh job secret (:mod:`medseg.distributed.comm.auth`), handed to the ranks in
their launch environment only (``MEDSEG_JOB_SECRET``; never logged, never in the run folder): the
ranks sign their heartbeats with it and authenticate the values in their channel's store.

Environment the launcher reads: ``MEDSEG_BEAT_HOST`` (the address ranks use to reach this process;
default 127.0.0.1 for a single-host job, else this machine's address on the route to the first
host), ``MEDSEG_HOROVODRUN_ARGS`` (extra horovodrun arguments, e.g. ``--network-interfaces br0``,
used by the site testbed). The heartbeat endpoint listens on that one address only.
"""

from __future__ import annotations

import importlib.util
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
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from medseg.config import Config
from medseg.distributed.comm import auth
from medseg.distributed.launch import rank_hosts
from medseg.distributed.launch.heartbeat import BEAT_ADDR_ENV, BeatServer, RankState, Watchdog, describe
from medseg.errors import ConfigError, RunError

log = logging.getLogger(__name__)
WORKER_ENV = "MEDSEG_WORKER"
# horovodrun (Gloo) prints "Process R exit with status code C." as each rank fails, and at the end
# names the first rank it saw fail as "Process name: R" then "Exit code: C".
_RANK_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
_FAILED_RANK = re.compile(r"^Process name: (\d+)")
_EXIT_CODE = re.compile(r"^Exit code: (-?\d+)")
_SSH_FAILED = re.compile(r"^ssh not successful for host (\S+?):?$")
_SIGTERM_CODES = (-15, 143)  # what horovodrun sends the remaining ranks after the first failure


class ExitLog:
    """The ranks' exits as horovodrun reports them, and the rank the job's failure is blamed on.

    horovodrun blames the rank whose exit its per-rank thread *noticed* first. When a rank is killed
    (SIGKILL from the OOM killer or a user, a segfault), its peers' collectives fail at once and a
    peer may exit with status 1 before horovodrun notices the dead rank (more likely on a loaded
    machine), so the healthy rank would be named. :meth:`culprit` therefore
    prefers a rank that was ended by a signal horovodrun did not send (anything but SIGTERM: a rank
    ends with status ``128 + signal`` or ``-signal``) over the first reported failure.
    """

    def __init__(self) -> None:
        self.exits: list[tuple[int, int]] = []  # (rank, exit code), in the order horovodrun saw them
        self.first: tuple[int, int | None] | None = None  # horovodrun's own "first process"
        self.ssh_host: str | None = None  # the host of horovodrun's last "ssh not successful" line
        self.unverified: list[str] = []  # hosts whose ssh host key was unknown or wrong

    def feed(self, line: str) -> None:
        line = line.strip()
        if m := _RANK_EXIT.match(line):
            self.exits.append((int(m.group(1)), int(m.group(2))))
        elif m := _FAILED_RANK.match(line):
            if self.first is None:
                self.first = (int(m.group(1)), None)
        elif (m := _EXIT_CODE.match(line)) and self.first is not None and self.first[1] is None:
            self.first = (self.first[0], int(m.group(1)))
        elif m := _SSH_FAILED.match(line):
            self.ssh_host = m.group(1)
        elif line.startswith("Host key verification failed") and self.ssh_host not in (
            None,
            *self.unverified,
        ):
            self.unverified.append(self.ssh_host)

    @staticmethod
    def by_signal(code: int) -> bool:
        """Ended by a signal other than horovodrun's SIGTERM."""
        return (code < 0 or 128 < code < 160) and code not in _SIGTERM_CODES

    def culprit(self) -> tuple[int, int | None] | None:
        """(rank, exit code) the failure is blamed on; None when horovodrun named no rank."""
        signalled = next(((r, c) for r, c in self.exits if self.by_signal(c)), None)
        if signalled is not None:
            return signalled
        if self.first is not None:
            return self.first
        return self.exits[0] if self.exits else None


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


def horovodrun_command() -> list[str]:
    """argv of Horovod's launcher: ``horovodrun`` less its per-launch build check (:mod:`.hvdrun`)."""
    if importlib.util.find_spec("horovod") is None:
        raise RunError("horovodrun not found: Horovod is not installed in this environment; run `make setup`")
    # run as a file: `-m medseg.distributed.launch.hvdrun` would first import the package (PyTorch, MONAI)
    return [sys.executable, str(Path(__file__).with_name("hvdrun.py"))]


def worker_command(config: Path, overrides: list[str], resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "medseg", "train", "--config", str(config), "--no-progress"]
    if resume:
        cmd.append("--resume")
    return cmd + list(overrides)


@dataclass
class _Attempt:
    """How one horovodrun of the job ended."""

    ok: bool
    message: str = ""  # what went wrong, naming the rank and its host
    rank: int | None = None  # the rank at fault (watchdog's culprit or the first that failed)
    code: int | None = None  # that rank's exit status (None when the watchdog stopped the job)
    reported: str = ""  # a MedsegError a rank reported (bad data or config: not a site failure)
    refused: int | None = None  # the rank whose update the ranks refused (a faulty or hostile site)


_Entry = tuple[str, str, int]  # a --hosts entry: (label, host for horovodrun, slots)


def _assign(entries: list[_Entry], np_: int) -> list[int]:
    """Index into ``entries`` of every rank (:func:`~medseg.distributed.launch.rank_hosts.slot_owners`)."""
    return rank_hosts.slot_owners([slots for _, _, slots in entries], np_)


def _reachable(host: str, port: int = 22, timeout: float = 3.0) -> bool:
    """Whether a dropped site answers on its ssh port again (it may rejoin at a restart)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def launch(
    cfg: Config,
    config_path: Path,
    overrides: list[str],
    np_: int,
    hosts: str | None,
    resume: bool,
    max_restarts: int = 0,
    min_sites: int = 1,
) -> None:
    """Run the job on ``np_`` ranks; raise RunError naming the rank when one fails or hangs.

    With ``max_restarts`` > 0, a site (a ``--hosts`` entry) whose rank died or went silent is left
    out and the job restarts from the last checkpoint with the sites still there (from scratch when
    there is none yet), at most ``max_restarts`` times; it stops with RunError (exit 2) when fewer
    than ``min_sites`` sites would remain. A site dropped earlier that answers on its ssh port again
    rejoins at the next restart. A site whose update the other sites refused (non-finite, wrong
    shape, norm out of bounds: :mod:`medseg.distributed.comm.checks`) is left out the same way, from
    the checkpoint written before that update, and never rejoins. Any other medseg error a rank
    stops on (bad data, bad config) is not a dropout: the job stops with that error.
    """
    last = cfg.run_dir / "checkpoints" / "last.pt"
    _check_job(cfg, np_, hosts, resume, max_restarts, min_sites, last)
    if not resume:
        shutil.rmtree(cfg.run_dir / "audit", ignore_errors=True)  # each site's log of what it sent
    entries = _host_entries(cfg, hosts, np_)
    active = [e for i, e in enumerate(entries) if i in set(_assign(entries, np_))]
    dropped: list[_Entry] = []
    refused: list[_Entry] = []  # sites whose updates were refused: left out for good
    restarts = 0
    while True:
        n = len(_assign(active, np_))
        hosts_arg = ",".join(f"{h}:{k}" for _, h, k in active)
        outcome = _attempt(cfg, config_path, overrides, n, hosts_arg, hosts is None, resume)
        if outcome.ok:
            return
        culprit = _site_at_fault(outcome)
        if culprit is None or restarts >= max_restarts:
            _give_up(outcome, config_path, n, last, restarts, max_restarts)
        lost = active[_assign(active, np_)[culprit]]
        if outcome.refused is not None:
            refused.append(lost)
        back = [e for e in dropped if e not in refused and _reachable(e[1])]
        dropped = [e for e in dropped if e not in back] + [lost]
        active = [e for e in entries if e not in dropped]
        restarts += 1
        if len(active) < min_sites:
            raise RunError(
                f"{outcome.message}. Site {lost[0]} is lost and only {len(active)} site(s) remain "
                f"({', '.join(e[0] for e in active) or 'none'}), fewer than --min-sites {min_sites}. "
                f"{_checkpoint_note(last)}"
            )
        resume = last.exists()
        where = f"from {_checkpoint_note(last).replace(' is intact', '')}" if resume else "from scratch"
        log.warning(
            "site %s dropped out (%s); restart %d of %d %s with sites %s%s",
            lost[0],
            outcome.message,
            restarts,
            max_restarts,
            where,
            ", ".join(e[0] for e in active),
            f" (back: {', '.join(e[0] for e in back)})" if back else "",
        )


def _site_at_fault(outcome: _Attempt) -> int | None:
    """The rank whose site a restart leaves out: the sender of a refused update, else the rank that
    died or went silent; None when the failure is not a site's (a reported error, exit status 2)."""
    if outcome.refused is not None:
        return outcome.refused
    if outcome.reported or outcome.rank is None or outcome.code == 2:
        return None
    return outcome.rank


def _check_job(
    cfg: Config, np_: int, hosts: str | None, resume: bool, max_restarts: int, min_sites: int, last: Path
) -> None:
    """Refuse a job the arguments or the run folder make impossible, before anything starts."""
    if np_ < 1:
        raise ConfigError("--np: needs at least 1 rank")
    if max_restarts < 0 or min_sites < 1:
        raise ConfigError("--max-restarts must be >= 0 and --min-sites >= 1")
    if cfg.dist.sync == "none":
        raise ConfigError(
            "dist.sync: 'none' trains in one process; pick bsp, gssp, ssp, local-sgd, bsp-hier, fedavg or diloco for --np"
        )
    if not resume and last.exists():
        raise RunError(
            f"{cfg.run_dir}: already holds a run; pass --resume to continue it, or name=<new name> to start another"
        )
    if cfg.sites and not hosts:
        raise ConfigError(
            f"sites: name the sites and their ranks in --hosts, e.g. --hosts {','.join(f'{s}:1' for s in cfg.sites)}"
        )


def _host_entries(cfg: Config, hosts: str | None, np_: int) -> list[_Entry]:
    """Every ``--hosts`` entry as (label, host for horovodrun, slots); sites are named by the config."""
    if not hosts:
        return [("localhost", "localhost", np_)]
    from medseg.distributed.site_data import horovodrun_hosts

    parse_hosts(hosts, np_)
    translated, labels = horovodrun_hosts(cfg, hosts)
    return [
        (label, item.rpartition(":")[0], int(item.rpartition(":")[2]))
        for label, item in zip(labels, translated.split(","))
    ]


def _give_up(
    outcome: _Attempt, config_path: Path, n: int, last: Path, restarts: int, max_restarts: int
) -> NoReturn:
    """Stop the job on a failed attempt that is not restarted: the rank's own error, or what failed."""
    hint = f"continue with `medseg train --config {config_path} --np {n} --resume`"
    if outcome.reported:
        raise RunError(outcome.reported)
    note = f"{_checkpoint_note(last)}; {hint}"
    if max_restarts:
        note = f"{restarts} of --max-restarts {max_restarts} used. " + note
    raise RunError(f"{outcome.message}. {note}")


def _attempt(
    cfg: Config,
    config_path: Path,
    overrides: list[str],
    np_: int,
    hosts_arg: str,
    single_host: bool,
    resume: bool,
) -> _Attempt:
    """One horovodrun of the job, watched to its end."""
    ranks_dir = cfg.run_dir / "ranks"
    shutil.rmtree(ranks_dir, ignore_errors=True)
    ranks_dir.mkdir(parents=True)
    timeout = cfg.dist.timeout_s
    cmd = [*horovodrun_command(), "-np", str(np_), "-H", hosts_arg, "--gloo", "--start-timeout", "60"]
    cmd += shlex.split(os.environ.get("MEDSEG_HOROVODRUN_ARGS", ""))
    cmd += worker_command(config_path, overrides, resume)
    beat_host = _beat_host(single_host, hosts_arg)
    try:
        beats = BeatServer(ranks_dir, bind=_bind_address(beat_host), secret=auth.new_secret())
    except OSError as exc:
        raise RunError(
            f"heartbeat endpoint: cannot listen on {beat_host} ({exc}); set MEDSEG_BEAT_HOST to this "
            "machine's address that the ranks reach it on"
        ) from None
    env = _rank_env(beat_host, beats.port, timeout, beats.secret)
    env[rank_hosts.RANK_HOSTS_ENV] = ",".join(rank_hosts.placement(hosts_arg, np_))
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
    exits = ExitLog()
    reader = threading.Thread(target=_pump, args=(proc, exits), daemon=True)
    reader.start()
    watchdog = Watchdog(np_, timeout)
    hung, states = _watch(proc, beats, watchdog)
    reader.join(timeout=5)
    reported = next((st.error for _, st in sorted(states.items()) if st.error), "")
    if hung is not None:
        return _Attempt(
            False,
            f"{hung} (dist.timeout_s={timeout:g}); all ranks were stopped",
            rank=watchdog.culprit,
            reported=reported,
        )
    if proc.returncode == 0:
        return _Attempt(True)
    failed = _failed(proc.returncode, exits, states, reported)
    failed.refused = _refused_rank(states, np_)
    return failed


def _refused_rank(states: dict[int, RankState], np_: int) -> int | None:
    """The rank the ranks named in their refusals, when they agree on one that is in this job."""
    named = {st.refused_rank for st in states.values() if st.refused_rank is not None}
    return named.pop() if len(named) == 1 and 0 <= next(iter(named)) < np_ else None


def _beat_host(single_host: bool, hosts_arg: str) -> str:
    """The address the ranks reach this launcher on: ``MEDSEG_BEAT_HOST``; loopback for a one-host
    job; else this machine's source address on the route to the first host (its name as a fallback)."""
    explicit = os.environ.get("MEDSEG_BEAT_HOST")
    if explicit:
        return explicit
    if single_host:
        return "127.0.0.1"
    first = hosts_arg.split(",")[0].rpartition(":")[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((first, 9))  # no packet is sent: this only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return socket.getfqdn()


def _bind_address(beat_host: str) -> str:
    """The local IPv4 address the heartbeat endpoint listens on (``beat_host`` resolved)."""
    try:
        return socket.gethostbyname(beat_host)
    except OSError as exc:
        raise RunError(
            f"heartbeat endpoint: cannot resolve {beat_host!r} ({exc}); set MEDSEG_BEAT_HOST to this "
            "machine's address that the ranks reach it on"
        ) from None


def _rank_env(beat_host: str, beat_port: int, timeout: float, secret: bytes) -> dict[str, str]:
    """horovodrun's environment, which its ranks inherit: how to reach the launcher, the job
    secret, and timeouts."""
    env = dict(os.environ, **{WORKER_ENV: "1", "PYTHONUNBUFFERED": "1"})
    env.update(auth.secret_env(secret))
    env[BEAT_ADDR_ENV] = f"{beat_host}:{beat_port}"
    env["MEDSEG_BEAT_TIMEOUT_S"] = str(int(timeout) + 30)  # a rank cut off from the launcher stops after this
    env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = "0"
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(timeout) + 60))
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning")  # N copies of library noise
    return env


def _pump(proc: subprocess.Popen, exits: ExitLog) -> None:
    """Copy horovodrun's output to ours, line by line, noting the ranks' exits as they are reported."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        exits.feed(line)


def _watch(
    proc: subprocess.Popen, beats: BeatServer, watchdog: Watchdog
) -> tuple[str | None, dict[int, RankState]]:
    """Wait for horovodrun to end, stopping the job when the watchdog finds a rank hung.

    Returns the watchdog's verdict (None when horovodrun ended by itself) and the ranks' last
    states; the beat endpoint is closed either way.
    """
    hung: str | None = None
    try:
        while True:
            try:
                proc.wait(timeout=1.0)  # returns as soon as horovodrun ends
                break
            except subprocess.TimeoutExpired:
                pass
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
    return hung, states


def _failed(returncode: int, exits: ExitLog, states: dict[int, RankState], reported: str) -> _Attempt:
    """A horovodrun that ended with an error: hosts ssh would not trust, else the rank
    :meth:`ExitLog.culprit` names."""
    if exits.unverified:
        return _Attempt(
            False,
            f"ssh refused {', '.join(exits.unverified)}: the host key is not in known_hosts or differs "
            "from it (medseg's launcher checks host keys). Compare the host's key fingerprint with its "
            "administrator (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` there) before adding it "
            "to ~/.ssh/known_hosts; a key that changed unexpectedly may be an impostor",
            reported=reported,
        )
    culprit = exits.culprit()
    if culprit is not None:
        rank, code = culprit
        what = f"{describe(rank, states.get(rank))} exited with status {code}" + (
            " (killed)" if code in (-9, 137, -15, 143) else ""
        )
        return _Attempt(
            False, f"{what}; the other ranks were stopped", rank=rank, code=code, reported=reported
        )
    return _Attempt(
        False,
        f"horovodrun exited with status {returncode}; the other ranks were stopped",
        reported=reported,
    )


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


# Imported by `import monai` (every MONAI submodule is imported eagerly, some of them pull these in
# through MONAI's optional_import) and never used by a training rank: pytorch-ignite (from
# monai.utils.enums; it also imports torch.distributed.optim and FSDP), scipy.signal (from
# monai.data.ultrasound_confidence_map) and pandas (monai.utils.profiling).
UNUSED_IN_RANKS = ("ignite", "scipy.signal", "pandas")
# Also never used by ranks other than 0, which alone plots the learning curve: matplotlib (from
# monai.utils.jupyter_utils, with the fonts and PIL parts it pulls in).
UNUSED_IN_OTHER_RANKS = ("matplotlib",)


def skip_unused_imports() -> None:
    """Make the packages of :data:`UNUSED_IN_RANKS` (and, in ranks other than 0,
    :data:`UNUSED_IN_OTHER_RANKS`) unimportable in this process (a rank).

    They are a sizeable part of the CPU time ``import monai`` takes, and a rank under a
    quarter-core CPU quota (the slow site of ``medseg bench sites``) pays that four times over in
    wall time, at every launch. MONAI's ``optional_import`` treats an unimportable package as absent
    and leaves a placeholder that raises only if used. Called before anything imports MONAI, in
    ranks only: a single-process ``medseg train``, evaluation, the viewer and exported bundles (whose
    evaluator runs on ignite) import everything as usual.
    """
    names = UNUSED_IN_RANKS
    if os.environ.get("HOROVOD_RANK", "0") != "0":
        names += UNUSED_IN_OTHER_RANKS
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment] - `import name` now raises ImportError


def end_rank() -> NoReturn:
    """End a rank whose training has returned: flush its output, then leave with ``os._exit(0)``.

    By then the session is closed (beats and channel closed, Horovod shut down unless its init had
    not ended within ``dist.timeout_s``: :class:`~medseg.distributed.channel_startup.HorovodInit`) and every file the
    rank wrote is closed. What a normal interpreter exit would still do is tear down the modules of
    PyTorch, MONAI and Horovod: about a second of CPU, which a rank of the slow site of
    ``medseg bench sites`` (a quarter-core quota) pays four times over in wall time before
    horovodrun sees the job end. Ranks only: the launcher and single-process commands exit normally.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
