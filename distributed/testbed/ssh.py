"""ssh into the sites: one sshd per site namespace, and the launcher's key, config and ``ssh`` wrapper.

horovodrun starts remote ranks with plain ``ssh <host>``; the wrapper in ``/run/medseg-sites/bin``
(put first on PATH) adds the testbed's key and config. Each sshd runs in its site's network
namespace with its own hostname (a UTS namespace) and in its site's CPU cgroup, so every rank it
starts is a process of that site.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from medseg.distributed.testbed.cgroups import join_command
from medseg.distributed.testbed.host import SSHD, alive, run, start_daemon
from medseg.distributed.testbed.netns import in_netns
from medseg.distributed.testbed.spec import STATE_DIR, Site, SitesError

SSH_CONFIG = STATE_DIR / "ssh_config"
BIN_DIR = STATE_DIR / "bin"  # first on PATH: its ``ssh`` uses the testbed's key and config
KEY = STATE_DIR / "id_ed25519"
AUTHORIZED_KEYS = STATE_DIR / "authorized_keys"
KNOWN_HOSTS = STATE_DIR / "known_hosts"  # every site's sshd host key, written as each sshd is made
RUN_SSHD = Path("/run/sshd")  # sshd's privilege-separation folder


def _client_config(sites: Sequence[Site]) -> str:
    hosts = " ".join(s.job_ip for s in sites)
    aliases = "".join(f"Host {s.hostname}\n    HostName {s.job_ip}\n" for s in sites)
    return (
        aliases
        + f"Host {hosts} {' '.join(s.hostname for s in sites)}\n"
        + "    User root\n"
        + f"    IdentityFile {KEY}\n"
        + "    IdentitiesOnly yes\n"
        + "    BatchMode yes\n"
        + "    StrictHostKeyChecking yes\n"
        + f"    UserKnownHostsFile {KNOWN_HOSTS}\n"
        + "    GlobalKnownHostsFile /dev/null\n"
        + "    LogLevel ERROR\n"
        + "    ConnectTimeout 10\n"
        + "    ServerAliveInterval 15\n"
        + "    ServerAliveCountMax 8\n"  # a loaded 2-core host can stall a tunnel for 45 s
    )


def make_client(sites: Sequence[Site]) -> bool:
    """The launcher's key (authorised at every site), ssh config and ``ssh`` wrapper; returns whether
    it had to make ``/run/sshd`` (then the sweep removes it again)."""
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "medseg-sites", "-f", str(KEY)])
    AUTHORIZED_KEYS.write_text(Path(f"{KEY}.pub").read_text())
    KNOWN_HOSTS.write_text("")  # start_sshd adds each site's host key
    SSH_CONFIG.write_text(_client_config(sites))
    BIN_DIR.mkdir(exist_ok=True)
    wrapper = BIN_DIR / "ssh"
    wrapper.write_text(
        f'#!/bin/sh\n# medseg sites: the testbed\'s ssh (key, config)\nexec /usr/bin/ssh -F {SSH_CONFIG} "$@"\n'
    )
    wrapper.chmod(0o755)
    if RUN_SSHD.exists():
        return False
    RUN_SSHD.mkdir(mode=0o755)
    return True


def _sshd_config(site: Site, host_key: Path) -> str:
    return (
        f"ListenAddress {site.job_ip}\n"  # the tunnel address in a secure testbed: never the WAN
        "Port 22\n"
        f"HostKey {host_key}\n"
        f"PidFile {site.dir / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {AUTHORIZED_KEYS}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "UseDNS no\n"
        "X11Forwarding no\n"
        "AllowTcpForwarding no\n"
        "PrintMotd no\n"
        "PrintLastLog no\n"
        "MaxStartups 64:30:128\n"
        "MaxSessions 64\n"
    )


def start_sshd(site: Site) -> subprocess.Popen:
    """Start the site's sshd (its own host key and config) in the site's cgroup, namespace and hostname."""
    site.dir.mkdir(parents=True, exist_ok=True)
    host_key = site.dir / "ssh_host_ed25519_key"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", site.hostname, "-f", str(host_key)])
    # the launcher checks this key (StrictHostKeyChecking yes), as it must a real hospital's host
    public = Path(f"{host_key}.pub").read_text().split()[:2]
    with KNOWN_HOSTS.open("a") as known:
        known.write(f"{site.job_ip},{site.hostname} {' '.join(public)}\n")
    cfg = site.dir / "sshd_config"
    cfg.write_text(_sshd_config(site, host_key))
    # Join the site's cgroup before entering the namespace: `ip netns exec` remounts /sys, and
    # the cgroup tree is not under the new mount. Every exec below keeps this one process id.
    join = join_command(site, " && ")
    inner = f"hostname {site.hostname} && exec {SSHD} -D -e -f {cfg}"
    argv = [
        "sh",
        "-c",
        f'{join}exec "$@"',
        "sh",
        *in_netns(site.netns, "unshare", "--uts", "--", "sh", "-c", inner),
    ]
    return start_daemon(argv, site.dir / "sshd.log")


def wait_sshd(site: Site, pid: int, timeout: float = 20.0) -> None:
    """Wait until ``ssh <site ip> hostname`` answers with the site's hostname."""
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        if not alive(pid):
            raise SitesError(f"sshd of {site.hostname} exited: see {site.dir / 'sshd.log'}")
        proc = subprocess.run(
            [str(BIN_DIR / "ssh"), "-o", "ConnectTimeout=2", site.job_ip, "hostname"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        if proc.returncode == 0 and proc.stdout.strip() == site.hostname:
            return
        last = (proc.stderr or proc.stdout).strip()
        time.sleep(0.2)
    raise SitesError(f"sshd of {site.hostname} ({site.job_ip}) did not answer in {timeout:g} s: {last}")
