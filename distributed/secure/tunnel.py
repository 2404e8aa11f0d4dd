"""The site link: a WireGuard tunnel between hospitals that medseg keys, configures, runs and removes.

Every site (and the launcher) gets a Curve25519 key pair and one address in a tunnel subnet (by
default 198.19.255.0/24, inside the benchmark range 198.18.0.0/15 and apart from any site's own
subnet). Each site's config lists every other member as a ``[Peer]``: its public key, its WAN
endpoint (``address:ListenPort``; none for a member that only dials out, such as the launcher) and
``AllowedIPs`` = that member's tunnel /32. A job then names the tunnel addresses (``--hosts``,
``/etc/hosts``, sshd's ``ListenAddress``, Horovod's ``--network-interfaces``), so ssh, Horovod,
Gloo, the store and the heartbeats all ride the tunnel, and the only port a site opens to the WAN
is the tunnel's UDP port.

The tunnel is Debian's ``wireguard-go`` (WireGuard in user space over a TUN device: the kernels
medseg meets may have no WireGuard module, and this one loads no modules at all) driven by ``wg``
from ``wireguard-tools``. Each tunnel runs in a private mount namespace with its own tmpfs on
``/run/wireguard`` (where ``wireguard-go`` puts its control socket and ``wg`` looks for it), so that
every member can use the same interface name (Horovod wants one name on all hosts) even when several
members share one machine, as the emulated sites do.

Threat model
------------
What it addresses: an **outsider on the WAN**, who can read, drop, replay, forge and inject packets
between hospitals (the internet, a provider, a shared WAN segment).

- Confidentiality and integrity: every packet between members is encrypted and authenticated
  (WireGuard: Noise IK handshake on Curve25519, ChaCha20-Poly1305, keys rotated every two minutes,
  a replay window). Gradients, parameters, store keys, heartbeats and the ssh launch ride inside.
- Peer authentication: a member accepts a packet only from a peer whose public key its config lists,
  and only with that peer's own tunnel source address (``AllowedIPs`` is one /32), so an outsider
  can neither pose as a site or a rank nor reach a socket bound to a tunnel address.
- Exposure: toward the WAN a member answers on one UDP port, and WireGuard stays silent to anything
  that is not a valid handshake from a known key.

What it does **not** address:

- A **compromised or faulty site**: it holds a valid key and its own tunnel address, so it is an
  authenticated peer; what it sends (poisoned updates, forged heartbeats, hostile objects) must be
  checked by the code that receives it (job secret, checked updates, no pickle: other parts of medseg).
- Anyone with root on a member (reads the private key and the plaintext), or on a site's own LAN
  when a socket binds ``0.0.0.0`` instead of the tunnel address: binding to the tunnel address is
  each service's job; a host firewall that drops everything but the UDP port on the WAN interface
  is the belt to those braces.
- Traffic analysis (sizes and timing stay visible), denial of service (the UDP port can be flooded
  or the path cut), and key distribution: public keys must reach the other sites over a trusted
  channel (compare fingerprints out of band), and revoking a site means removing its ``[Peer]``
  everywhere.

Private keys are made by ``wg genkey``, handed to ``wg pubkey`` on stdin (never in an argv, which
``/proc`` shows to everyone), written 0600 into a 0700 folder, and never logged.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from medseg.errors import MedsegError

log = logging.getLogger(__name__)

DEFAULT_NET = ipaddress.ip_network("198.19.255.0/24")
DEFAULT_PORT = 51820
DEFAULT_IFACE = "medseg-wg"
MTU = 1420  # WireGuard's default: 1500 minus the 60 bytes of IPv4 + UDP + WireGuard framing
KEEPALIVE_S = 25  # members that dial out keep their handshake (and any NAT mapping) alive
SOCKET_DIR = Path("/run/wireguard")  # where wireguard-go puts its control socket and wg looks
TOOLS = ("wireguard-go", "wg", "ip", "unshare", "nsenter")
WAN_OVERHEAD_BYTES = 60  # per packet: outer IPv4 (20) + UDP (8) + WireGuard header (16) + tag (16)

# Runs inside the tunnel's own mount namespace: a private /run/wireguard, then wireguard-go itself
# (exec keeps the process id, so the id we record is the tunnel's).
_START = 'mount -t tmpfs -o mode=0700,size=64k medseg-wg /run/wireguard && exec wireguard-go -f "$1"'


class TunnelError(MedsegError):
    """The site link cannot be keyed, configured, started or checked; the message says what to do."""


def check_tools() -> None:
    """Raise TunnelError naming the missing tools (``make sites-deps`` installs them)."""
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:
        raise TunnelError(
            f"the site link needs {', '.join(missing)}: run `make sites-deps` "
            "(apt-get install --no-install-recommends wireguard-go wireguard-tools iproute2 util-linux)"
        )


# ----------------------------------------------------------------------------------------- keys


def validate_key(key: str, what: str = "key") -> str:
    """``key`` stripped, when it is a WireGuard key (base64 of 32 bytes); else TunnelError."""
    key = key.strip()
    try:
        raw = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32 or len(key) != 44:
        raise TunnelError(f"{what} is not a WireGuard key (base64 of 32 bytes)")
    return key


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600 from the start, then renamed in)."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _wg(args: Sequence[str], stdin: str | None = None, prefix: Sequence[str] = ()) -> str:
    """Run ``wg args`` (inside ``prefix``); its stdout. Errors never echo ``stdin`` (it may be a key)."""
    try:
        proc = subprocess.run([*prefix, "wg", *args], input=stdin, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TunnelError(f"`wg {args[0]}` did not run: {exc}") from None
    if proc.returncode != 0:
        raise TunnelError(f"`wg {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


@dataclass(frozen=True)
class KeyPair:
    """A member's key pair: the private key stays in ``private_path`` (0600), the public one travels."""

    name: str
    private_path: Path
    public_key: str

    def private_key(self) -> str:
        return read_private_key(self.private_path)


def generate_keypair(folder: Path, name: str) -> KeyPair:
    """A new key pair for member ``name``: ``<folder>/<name>.key`` (0600, in a 0700 folder) and
    ``<name>.pub``; ``wg genkey`` makes the private key, ``wg pubkey`` reads it on stdin."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    private = validate_key(_wg(["genkey"]), "wg genkey's output")
    public = validate_key(_wg(["pubkey"], stdin=private + "\n"), "wg pubkey's output")
    path = folder / f"{name}.key"
    write_secret(path, private + "\n")
    (folder / f"{name}.pub").write_text(public + "\n")
    log.debug("site link: key pair for %s made (public %s)", name, public)
    return KeyPair(name, path, public)


def read_private_key(path: Path) -> str:
    """The private key in ``path``; TunnelError when the file is readable by others or is no key."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise TunnelError(f"{path} is readable by others (mode {mode:o}): chmod 600 it, or make a new key")
    return validate_key(path.read_text(), str(path))


# ----------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Member:
    """One end of the site link: a site or the launcher.

    ``tunnel_ip``: its address inside the tunnel (its peers' ``AllowedIPs`` is this /32).
    ``endpoint``: where the others reach its UDP port on the WAN (``198.18.1.1:51820``), or None for
    a member that only dials out (the launcher): the others learn its address from its handshake.
    ``listen_port``: its own UDP port (None: any free one, for a member that only dials out).
    """

    name: str
    tunnel_ip: str
    public_key: str
    endpoint: str | None = None
    listen_port: int | None = DEFAULT_PORT

    def __post_init__(self) -> None:
        validate_key(self.public_key, f"{self.name}'s public key")
        ipaddress.IPv4Address(self.tunnel_ip)
        if self.endpoint is not None:
            host, _, port = self.endpoint.rpartition(":")
            ipaddress.IPv4Address(host)
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise TunnelError(f"{self.name}'s endpoint {self.endpoint!r} is not ADDRESS:PORT")
        if self.listen_port is not None and not 0 < self.listen_port < 65536:
            raise TunnelError(f"{self.name}'s listen port {self.listen_port} is out of range")


def tunnel_address(index: int, net: ipaddress.IPv4Network = DEFAULT_NET) -> str:
    """The ``index``-th host address of the tunnel subnet (1 = the first host)."""
    if not 0 < index < net.num_addresses - 1:
        raise TunnelError(f"tunnel address {index} is outside {net}")
    return str(net.network_address + index)


def peer_section(peer: Member, keepalive_s: int = 0) -> str:
    """One ``[Peer]`` of a ``wg setconf`` file: key, endpoint (if any), its tunnel /32, keepalive."""
    lines = ["[Peer]", f"PublicKey = {validate_key(peer.public_key, peer.name)}"]
    if peer.endpoint:
        lines.append(f"Endpoint = {peer.endpoint}")
    lines.append(f"AllowedIPs = {peer.tunnel_ip}/32")
    if keepalive_s:
        lines.append(f"PersistentKeepalive = {keepalive_s}")
    return "\n".join(lines) + "\n"


def interface_config(
    private_key: str, listen_port: int | None, peers: Sequence[Member], keepalive_s: int = 0
) -> str:
    """A ``wg setconf`` file: ``[Interface]`` (private key, listen port) and one ``[Peer]`` each.

    The tunnel address is not in it (``wg`` does not take one): :class:`Tunnel` sets it with ``ip``.
    """
    lines = ["[Interface]", f"PrivateKey = {validate_key(private_key, 'the private key')}"]
    if listen_port is not None:
        lines.append(f"ListenPort = {listen_port}")
    names = [p.name for p in peers]
    ips = [p.tunnel_ip for p in peers]
    if len(set(names)) != len(names) or len(set(ips)) != len(ips):
        raise TunnelError(f"peers must have distinct names and tunnel addresses: {list(zip(names, ips))}")
    return "\n".join(lines) + "\n" + "".join("\n" + peer_section(p, keepalive_s) for p in peers)


def mesh_config(me: Member, private_key: str, members: Sequence[Member]) -> str:
    """``me``'s config in a full mesh: every other member is a peer. A member without an endpoint
    (it only dials out) keeps its handshakes alive toward the others (``PersistentKeepalive``)."""
    if me.name not in {m.name for m in members}:
        raise TunnelError(f"{me.name} is not a member of the mesh")
    peers = [m for m in members if m.name != me.name]
    keepalive = KEEPALIVE_S if me.endpoint is None else 0
    return interface_config(private_key, me.listen_port, peers, keepalive)


# ----------------------------------------------------------------------------------------- lifecycle


def prepare_socket_dir() -> bool:
    """Make ``/run/wireguard`` (the mount point of each tunnel's private socket folder) when missing;
    returns whether it was made here (the caller removes it again when done)."""
    if SOCKET_DIR.is_dir():
        return False
    SOCKET_DIR.mkdir(mode=0o700, parents=True)
    return True


def is_tunnel_process(pid: int, iface: str) -> bool:
    """Whether ``pid`` is a ``wireguard-go -f <iface>`` process (so a recycled pid is never signalled)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return len(argv) >= 3 and argv[0].endswith(b"wireguard-go") and argv[1:3] == [b"-f", iface.encode()]


def stop_process(pid: int, iface: str, grace: float = 5.0) -> bool:
    """SIGTERM, then SIGKILL, the tunnel process ``pid`` (checked to be ``wireguard-go -f <iface>``);
    its TUN device goes with it. Returns whether there was such a process."""
    if not is_tunnel_process(pid, iface):
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)  # our child: reap it
            if not is_tunnel_process(pid, iface):
                return True
            time.sleep(0.05)
    log.warning("site link: tunnel process %d (%s) did not exit after SIGKILL", pid, iface)
    return True


class Tunnel:
    """One member's end of the site link: ``wireguard-go`` on ``iface``, configured and addressed.

    ``netns``: the network namespace to run in (None: this process's). With ``private_socket`` (the
    default) the tunnel gets its own mount namespace and tmpfs ``/run/wireguard``, so members on one
    machine can share an interface name; ``wg`` then reaches it through ``nsenter`` (:meth:`prefix`).
    ``start`` brings it up (and leaves nothing behind when it fails), ``stop`` ends it; the process
    id (``pid``) can be recorded and ended later by :func:`stop_process`.
    """

    def __init__(
        self,
        config: Path,
        address: str,
        *,
        iface: str = DEFAULT_IFACE,
        netns: str | None = None,
        private_socket: bool = True,
        log_path: Path | None = None,
        mtu: int = MTU,
    ) -> None:
        ipaddress.IPv4Interface(address)
        if not 0 < len(iface) <= 15 or not all(c.isalnum() or c in "-_" for c in iface):
            raise TunnelError(f"interface name {iface!r}: 1 to 15 letters, digits, - or _")
        self.config, self.address, self.iface, self.netns = config, address, iface, netns
        self.private_socket, self.log_path, self.mtu = private_socket, log_path, mtu
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def prefix(self) -> list[str]:
        """argv prefix that runs a command where the tunnel is (its network and mount namespaces)."""
        if self.proc and (self.private_socket or self.netns):
            return ["nsenter", f"--target={self.proc.pid}", "--mount", "--net", "--"]
        return []

    def _argv(self) -> list[str]:
        argv = ["ip", "netns", "exec", self.netns] if self.netns else []
        if self.private_socket:
            return argv + [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                _START,
                "sh",
                self.iface,
            ]
        return argv + ["wireguard-go", "-f", self.iface]

    def start(self, timeout: float = 15.0) -> int:
        """Start ``wireguard-go``, load the config (``wg setconf``), set the address, MTU and link up;
        returns the process id. On any failure the process is ended and TunnelError raised."""
        check_tools()
        if self.proc is not None:
            raise TunnelError(f"tunnel {self.iface} is already started (process {self.proc.pid})")
        if not self.config.is_file():
            raise TunnelError(f"tunnel config {self.config} does not exist")
        if self.private_socket and not SOCKET_DIR.is_dir():
            raise TunnelError(f"{SOCKET_DIR} is missing: call prepare_socket_dir() first")
        env = dict(os.environ, LOG_LEVEL="error", WG_PROCESS_FOREGROUND="1")
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self._argv(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        finally:
            if self.log_path:
                out.close()  # type: ignore[union-attr]
        try:
            self._wait_ready(timeout)
            _wg(["setconf", self.iface, str(self.config)], prefix=self.prefix())
            self._ip(["address", "add", self.address, "dev", self.iface])
            self._ip(["link", "set", self.iface, "mtu", str(self.mtu), "up"])
        except BaseException:
            self.stop()
            raise
        log.info(
            "site link: %s up at %s%s (process %d)",
            self.iface,
            self.address,
            f" in {self.netns}" if self.netns else "",
            self.proc.pid,
        )
        return self.proc.pid

    def _wait_ready(self, timeout: float) -> None:
        """Until ``wg show <iface>`` answers inside the tunnel's namespaces (its socket is there)."""
        assert self.proc is not None
        end = time.monotonic() + timeout
        last = ""
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise TunnelError(
                    f"wireguard-go for {self.iface} exited at start ({self.proc.returncode})"
                    + (f": see {self.log_path}" if self.log_path else "")
                )
            try:
                _wg(["show", self.iface, "listen-port"], prefix=self.prefix())
                return
            except TunnelError as exc:
                last = str(exc)
            time.sleep(0.05)
        raise TunnelError(f"wireguard-go for {self.iface} did not answer in {timeout:g} s: {last}")

    def _ip(self, args: Sequence[str]) -> None:
        proc = subprocess.run([*self.prefix(), "ip", *args], capture_output=True, text=True, timeout=20)
        if proc.returncode != 0:
            raise TunnelError(f"`ip {' '.join(args)}` for {self.iface} failed: {proc.stderr.strip()}")

    def show(self) -> dict:
        """The tunnel's listen port and, per peer public key: endpoint, allowed IPs, last handshake
        (unix time, 0: none yet) and bytes received and sent (``wg show <iface> dump``, key line left out)."""
        lines = _wg(["show", self.iface, "dump"], prefix=self.prefix()).splitlines()
        port = int(lines[0].split("\t")[2]) if lines else 0
        peers = {}
        for line in lines[1:]:
            f = line.split("\t")
            peers[f[0]] = {
                "endpoint": None if f[2] == "(none)" else f[2],
                "allowed_ips": f[3],
                "latest_handshake": int(f[4]),
                "rx_bytes": int(f[5]),
                "tx_bytes": int(f[6]),
            }
        return {"iface": self.iface, "listen_port": port, "peers": peers}

    def stop(self) -> None:
        """End the tunnel process (its TUN device, address and routes go with it)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        log.info("site link: %s stopped%s", self.iface, f" in {self.netns}" if self.netns else "")
        self.proc = None

    def __enter__(self) -> Tunnel:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
