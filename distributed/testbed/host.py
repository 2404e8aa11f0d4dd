"""The machine under the testbed: what it must have, running commands on it, and its processes."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from medseg.distributed.testbed.spec import CGROUP_ROOT, SitesError

log = logging.getLogger(__name__)

SSHD = "/usr/sbin/sshd"


def check_host(cpu: bool = False, secure: bool = False) -> None:
    """Raise SitesError unless this process can build a testbed: root, iproute2, util-linux, sshd, TUN
    (and, for a ``secure`` one, wireguard-go and wg)."""
    if sys.platform != "linux":
        raise SitesError("the sites testbed needs Linux network namespaces")
    if os.geteuid() != 0:
        raise SitesError(
            "the sites testbed needs root (network namespaces, veths, tc, cgroups); run it as root"
        )
    missing = [t for t in ("ip", "tc", "unshare", "nsenter", "ssh", "ssh-keygen") if not shutil.which(t)]
    if not os.path.exists(SSHD):
        missing.append(SSHD)
    if secure:
        missing += [t for t in ("wireguard-go", "wg") if not shutil.which(t)]
    if missing:
        raise SitesError(
            f"the sites testbed needs {', '.join(missing)}: run `make sites-deps` "
            "(apt-get install openssh-server openssh-client iproute2 util-linux"
            + (" wireguard-go wireguard-tools)" if secure else ")")
        )
    if not os.path.exists("/dev/net/tun"):
        raise SitesError("/dev/net/tun is missing: the WAN relay needs TUN devices")
    if cpu and not (CGROUP_ROOT / "cpu.cfs_quota_us").exists():
        raise SitesError(f"--cpu needs cgroup v1 cpu mounted at {CGROUP_ROOT} (cpu.cfs_quota_us not found)")


def run(argv: str | Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a command (a string is split on spaces: only for our own names and numbers); SitesError on failure."""
    argv = argv.split() if isinstance(argv, str) else list(argv)
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SitesError(f"`{' '.join(argv)}` did not finish in {timeout:g} s") from None
    if check and proc.returncode != 0:
        raise SitesError(
            f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def cmdline(pid: int) -> str:
    """Process ``pid``'s command line, arguments joined by spaces ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_all(pids: set[int], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every process in ``pids`` (never this one, its parent or init)."""
    pids -= {os.getpid(), os.getppid(), 0, 1}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(alive(p) for p in pids):
            time.sleep(0.05)
        # Reap our own children (the relay and sshds were started by this process when it ran `up`).
        for pid in pids:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        pids = {p for p in pids if alive(p)}
        if not pids:
            return
    if pids:
        log.warning("sites: processes %s did not exit after SIGKILL", sorted(pids))


def start_daemon(argv: Sequence[str], log_path: Path) -> subprocess.Popen:
    """Start a long-running process in its own session, its output appended to ``log_path``."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
