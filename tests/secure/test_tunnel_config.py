"""The site link's config text, keys and the testbed's secure names: no root needed.

Each config is read back section by section, so a wrong peer, endpoint or AllowedIPs fails a test.
"""

from __future__ import annotations

import base64
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from medseg.distributed.secure.tunnel import (
    KEEPALIVE_S,
    Member,
    TunnelError,
    generate_keypair,
    interface_config,
    mesh_config,
    read_private_key,
    tunnel_address,
    validate_key,
)

# Fixed keys (base64 of 32 bytes) so the text is predictable; real ones come from `wg genkey`.
PRIV = {n: base64.b64encode(bytes([i]) * 32).decode() for i, n in enumerate("ablx", 1)}
PUB = {n: base64.b64encode(bytes([i + 100]) * 32).decode() for i, n in enumerate("ablx", 1)}


def _members() -> list[Member]:
    return [
        Member("site-a", "198.19.255.1", PUB["a"], "198.18.1.1:51820", 51820),
        Member("site-b", "198.19.255.2", PUB["b"], "198.18.2.1:51820", 51820),
        Member("launcher", "198.19.255.254", PUB["l"], None, None),
    ]


def _sections(text: str) -> list[tuple[str, dict[str, str]]]:
    """A wg config as [(section, {key: value})] in order."""
    out: list[tuple[str, dict[str, str]]] = []
    for line in text.splitlines():
        if line.startswith("["):
            out.append((line.strip("[]"), {}))
        elif line.strip():
            key, _, value = line.partition(" = ")
            assert key not in out[-1][1], f"{key} twice in one section"
            out[-1][1][key] = value
    return out


def test_a_site_config_lists_every_other_member_by_key_endpoint_and_tunnel_address() -> None:
    members = _members()
    text = mesh_config(members[0], PRIV["a"], members)
    assert _sections(text) == [
        ("Interface", {"PrivateKey": PRIV["a"], "ListenPort": "51820"}),
        ("Peer", {"PublicKey": PUB["b"], "Endpoint": "198.18.2.1:51820", "AllowedIPs": "198.19.255.2/32"}),
        # the launcher only dials out: no endpoint, the site learns it from the handshake
        ("Peer", {"PublicKey": PUB["l"], "AllowedIPs": "198.19.255.254/32"}),
    ]
    assert PUB["a"] not in text  # a site is never its own peer


def test_the_launcher_config_has_no_port_and_keeps_its_handshakes_alive() -> None:
    members = _members()
    sections = _sections(mesh_config(members[2], PRIV["l"], members))
    assert sections[0] == ("Interface", {"PrivateKey": PRIV["l"]})
    assert [s[1]["Endpoint"] for s in sections[1:]] == ["198.18.1.1:51820", "198.18.2.1:51820"]
    assert [s[1]["AllowedIPs"] for s in sections[1:]] == ["198.19.255.1/32", "198.19.255.2/32"]
    assert all(s[1]["PersistentKeepalive"] == str(KEEPALIVE_S) for s in sections[1:])


def test_what_would_widen_or_inject_into_a_config_is_refused() -> None:
    members = _members()
    # a key with a line break would add a line of the attacker's choosing (AllowedIPs = 0.0.0.0/0)
    with pytest.raises(TunnelError, match="not a WireGuard key"):
        Member("evil", "198.19.255.9", PUB["x"][:-1] + "\nAllowedIPs = 0.0.0.0/0", "198.18.9.1:51820")
    with pytest.raises(TunnelError, match="not a WireGuard key"):
        interface_config("not-a-key", 51820, members)
    with pytest.raises(TunnelError, match="distinct"):
        interface_config(PRIV["a"], 51820, [*members, Member("site-c", "198.19.255.1", PUB["x"])])
    with pytest.raises(TunnelError, match="ADDRESS:PORT"):
        Member("site-c", "198.19.255.3", PUB["x"], "198.18.3.1:0")
    with pytest.raises(ValueError):
        Member("site-c", "198.19.255.3", PUB["x"], "site-c.example:51820")  # endpoints are addresses
    with pytest.raises(TunnelError, match="not a member"):
        mesh_config(Member("site-c", "198.19.255.3", PUB["x"]), PRIV["x"], members)
    assert tunnel_address(1) == "198.19.255.1" and tunnel_address(254) == "198.19.255.254"
    with pytest.raises(TunnelError, match="outside"):
        tunnel_address(255)


@pytest.mark.skipif(
    shutil.which("wg") is None, reason="wireguard-tools' wg is missing: run `make sites-deps`"
)
def test_keys_are_private_to_their_owner_and_never_logged(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    pair = generate_keypair(tmp_path / "keys", "site-a")
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    assert pair.private_path.stat().st_mode & 0o777 == 0o600
    private = pair.private_key()
    assert validate_key(private) == private
    again = subprocess.run(["wg", "pubkey"], input=private, capture_output=True, text=True, check=True)
    assert again.stdout.strip() == pair.public_key
    assert private not in caplog.text and pair.public_key in caplog.text
    pair.private_path.chmod(0o644)
    with pytest.raises(TunnelError, match="readable by others"):
        read_private_key(pair.private_path)
    assert generate_keypair(tmp_path / "keys", "site-b").public_key != pair.public_key


def test_a_secure_testbed_gives_jobs_the_tunnel_addresses() -> None:
    from medseg.distributed.testbed import ssh
    from medseg.distributed.testbed.spec import Site

    plain = [Site("a", 1, 2, None), Site("b", 2, 2, None)]
    secure = [Site("a", 1, 2, None, True), Site("b", 2, 2, None, True)]
    assert [s.job_ip for s in plain] == ["198.18.1.1", "198.18.2.1"]  # unchanged without --secure
    assert [s.job_ip for s in secure] == ["198.19.255.1", "198.19.255.2"]
    assert [s.wg_endpoint for s in secure] == ["198.18.1.1:51820", "198.18.2.1:51820"]
    assert "ListenAddress 198.19.255.1\n" in ssh._sshd_config(secure[0], Path("/k"))
    assert "ListenAddress 198.18.1.1\n" in ssh._sshd_config(plain[0], Path("/k"))
    client = ssh._client_config(secure)
    assert "HostName 198.19.255.2" in client and "198.18." not in client
