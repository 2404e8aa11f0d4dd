"""Removing a testbed: everything named ``msite*`` / ``medseg-sites``, whoever made it and however far
it got, so that ``down`` (and ``up`` after a crash) also clears what a half-finished ``up`` left."""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

from medseg.distributed.secure.tunnel import SOCKET_DIR, is_tunnel_process, stop_process
from medseg.distributed.testbed.cgroups import BASE as CGROUP_BASE
from medseg.distributed.testbed.cgroups import cgroup_pids, remove_cgroups
from medseg.distributed.testbed.host import alive, cmdline, kill_all, run
from medseg.distributed.testbed.link import KEY_DIR
from medseg.distributed.testbed.netns import RELAY, netns_pids, our_namespaces
from medseg.distributed.testbed.spec import IFACE, PREFIX, STATE_DIR, WG_IFACE
from medseg.distributed.testbed.ssh import RUN_SSHD
from medseg.distributed.testbed.state import STATE_FILE, lock, read_state

ETC_NETNS = Path("/etc/netns")


def _end_processes(namespaces: list[str], state: dict | None) -> list[str]:
    """End the processes in our namespaces and cgroups, and the relay the state file names."""
    pids = cgroup_pids()
    for netns in namespaces:
        pids |= netns_pids(netns)
    if state:
        relay = state.get("pids", {}).get("relay")
        if relay and alive(relay) and "relay" in cmdline(relay):
            pids.add(relay)
    if not pids:
        return []
    kill_all(pids)
    return [f"processes {sorted(pids)}"]


def _tunnel_pids() -> set[int]:
    """Every ``wireguard-go -f msitewg`` process on the machine, in any namespace (the site link's
    tunnels: the launcher's lives in the root namespace, outside every site namespace and cgroup)."""
    return {
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit() and is_tunnel_process(int(d.name), WG_IFACE)
    }


def _end_tunnels() -> list[str]:
    """End the site link's tunnel processes (their TUN devices go with them)."""
    pids = sorted(p for p in _tunnel_pids() if stop_process(p, WG_IFACE))
    return [f"tunnel processes {pids}"] if pids else []


def _remove_etc_netns() -> list[str]:
    removed = []
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.glob(f"{PREFIX}*"):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
        with contextlib.suppress(OSError):
            ETC_NETNS.rmdir()  # only when empty: someone else's entries stay
    return removed


def sweep() -> list[str]:
    """Remove everything a testbed (finished, crashed or half made) left: returns what was removed.

    Processes in our namespaces or cgroups (sshd, ranks, relay) are ended first (SIGTERM, then
    SIGKILL), then the namespaces (which takes their veths and TUN devices with them), the root
    ``msite0`` link, ``/etc/netns/msite-*``, the cgroups and the state files.
    """
    namespaces = our_namespaces()
    state = read_state()
    removed = _end_tunnels()
    removed += _end_processes(namespaces, state)
    for netns in namespaces:
        run(["ip", "netns", "del", netns], check=False)
        removed.append(f"netns {netns}")
    for dev in (IFACE, WG_IFACE):
        if run(["ip", "link", "show", dev], check=False).returncode == 0:
            run(["ip", "link", "del", dev], check=False)
            removed.append(f"link {dev}")
    removed += _remove_etc_netns()
    removed += remove_cgroups()
    if STATE_DIR.is_dir():
        for p in STATE_DIR.iterdir():
            if p.name != "lock":
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    if state and state.get("made_run_sshd"):
        with contextlib.suppress(OSError):
            RUN_SSHD.rmdir()
    if state and state.get("made_run_wireguard"):
        with contextlib.suppress(OSError):
            SOCKET_DIR.rmdir()  # only when empty: each tunnel's socket lived in its own tmpfs
    return removed


def down() -> list[str]:
    """Remove the testbed on this machine, whoever made it, and whatever a crash left (see :func:`sweep`)."""
    with lock():
        return sweep()


def leftovers() -> list[str]:
    """What of a testbed still exists on this machine (empty after a clean ``down``): for tests."""
    found = [f"netns {n}" for n in our_namespaces()]
    links = run(["ip", "-o", "link", "show"], check=False).stdout
    found += [f"link {m}" for m in re.findall(r"^\d+: (msite[^:@ ]*)", links, flags=re.M)]
    if CGROUP_BASE.exists():
        found.append(f"cgroup {CGROUP_BASE}")
    if ETC_NETNS.is_dir():
        found += [str(d) for d in ETC_NETNS.glob(f"{PREFIX}*")]
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            cmd = cmdline(int(pid_dir.name))
            if str(STATE_DIR) in cmd or str(RELAY) in cmd or is_tunnel_process(int(pid_dir.name), WG_IFACE):
                found.append(f"process {pid_dir.name}: {cmd[:100]}")
    if STATE_FILE.exists():
        found.append(str(STATE_FILE))
    if KEY_DIR.exists():
        found.append(f"keys {KEY_DIR}")
    return found
