"""CPU quotas of the sites: one cgroup per site under cgroup v1 ``cpu``.

``/sys/fs/cgroup/cpu/medseg-sites/<site>`` gets quota = ranks x cores-per-rank (per CFS period) and
a high ``cpu.shares``; the site's sshd, hence every rank it starts, lives in it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

from medseg.distributed.testbed.spec import CGROUP_NAME, CGROUP_ROOT, Site, SitesError

log = logging.getLogger(__name__)

CFS_PERIOD_US = 20000  # 20 ms: a throttled rank waits at most a few ms, not the default 100 ms
CPU_SHARES = 8192  # 8x a normal task's weight, so other work on the machine disturbs the sites less
BASE = CGROUP_ROOT / CGROUP_NAME


def make_cgroups(sites: Sequence[Site]) -> None:
    """One cgroup per site with its CPU quota (none without ``cores_per_rank``); without cgroup v1
    ``cpu`` the sites run uncapped, or SitesError when a quota was asked for."""
    if not (CGROUP_ROOT / "cpu.shares").exists():
        if any(s.cores_per_rank for s in sites):
            raise SitesError(f"--cpu needs cgroup v1 cpu at {CGROUP_ROOT}")
        log.warning("sites: no cgroup v1 cpu at %s; sites run without CPU cgroups", CGROUP_ROOT)
        return
    BASE.mkdir(exist_ok=True)
    (BASE / "cpu.shares").write_text(str(CPU_SHARES))
    for site in sites:
        site.cgroup.mkdir(exist_ok=True)
        (site.cgroup / "cpu.shares").write_text(str(CPU_SHARES))
        (site.cgroup / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        quota = -1
        if site.cores_per_rank:
            quota = max(1000, int(site.ranks * site.cores_per_rank * CFS_PERIOD_US))
        (site.cgroup / "cpu.cfs_quota_us").write_text(str(quota))


def join_command(site: Site, then: str) -> str:
    """Shell text that moves the shell into the site's cgroup (when it exists), followed by ``then``."""
    return f"echo $$ > {site.cgroup}/cgroup.procs{then}" if site.cgroup.is_dir() else ""


def quota_cores(site: Site) -> float | None:
    """The site's CPU quota in cores (None: not capped, or no cgroup)."""
    quota = None
    with contextlib.suppress(OSError):
        q = int((site.cgroup / "cpu.cfs_quota_us").read_text())
        quota = None if q < 0 else q / int((site.cgroup / "cpu.cfs_period_us").read_text())
    return quota


def cgroup_pids() -> set[int]:
    """The processes in the testbed's cgroups."""
    pids: set[int] = set()
    if BASE.is_dir():
        for procs in BASE.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in procs.read_text().split()}
    return pids


def remove_cgroups() -> list[str]:
    """Remove the testbed's cgroups (their tasks must have ended); returns what was removed."""
    if not BASE.is_dir():
        return []
    for attempt in range(50):  # killed tasks leave their cgroup asynchronously
        try:
            for d in sorted((p for p in BASE.iterdir() if p.is_dir()), reverse=True):
                if d.is_dir():
                    d.rmdir()
            BASE.rmdir()
            break
        except OSError as exc:
            if attempt == 49:
                log.warning("sites: could not remove cgroup %s: %s", BASE, exc)
            time.sleep(0.1)
    return [f"cgroup {BASE}"]
