"""The channel's store address through Horovod's own rendezvous server (the one ``horovodrun --gloo``
starts), so the channel can be built while ``hvd.init()`` runs: the address arrives signed, a
forged, foreign-secret or other-launch value is refused, a proxy in the environment is never used,
waiting ends in a clear error, and two ranks build a working channel from horovodrun's environment
alone (no Horovod call)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from medseg.distributed import channel_startup
from medseg.distributed.background import InBackground
from medseg.distributed.comm import auth, rendezvous_kv
from medseg.distributed.comm.store_address import ADDRESS_KEY, rendezvous_address
from medseg.errors import RunError

http_server = pytest.importorskip(
    "horovod.runner.http.http_server", reason="Horovod is built by `make setup`"
)
PROBE = Path(__file__).with_name("mp") / "channel_beside.py"


@pytest.fixture
def server():
    """Horovod's rendezvous server, as horovodrun runs it, on the loopback address."""
    rendezvous = http_server.RendezvousServer()
    port = rendezvous.start()
    yield ("127.0.0.1", port)
    rendezvous.stop()


def test_the_store_address_reaches_a_rank_that_asked_before_rank_0_put_it(server, monkeypatch) -> None:
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("http_proxy", "http://198.18.0.9:9")  # a dead proxy: requests must not use it
    monkeypatch.setenv("HTTP_PROXY", "http://198.18.0.9:9")
    answers: list[int] = []
    plain = rendezvous_kv._request

    def seen(*args, **kwargs):
        status, body = plain(*args, **kwargs)
        answers.append(status)
        return status, body

    monkeypatch.setattr(rendezvous_kv, "_request", seen)
    secret = secrets.token_bytes(32)
    got: list[tuple[str, int]] = []
    reader = threading.Thread(target=lambda: got.append(rendezvous_address(server, secret, None, 30, 2)))
    reader.start()
    for _ in range(200):  # the reader has been told "not yet" before rank 0 puts the address
        if 404 in answers:
            break
        threading.Event().wait(0.05)
    assert 404 in answers
    assert rendezvous_address(server, secret, ("198.18.0.1", 4321), 30, 2) == ("198.18.0.1", 4321)
    reader.join(timeout=30)
    assert got == [("198.18.0.1", 4321)]


@pytest.mark.parametrize("planted", ["another secret", "another launch", "unsigned"])
def test_a_forged_or_replayed_address_is_refused(server, planted) -> None:
    secret = secrets.token_bytes(32)
    if planted == "another secret":
        rendezvous_address(server, secrets.token_bytes(32), ("198.18.0.66", 1), 30, 2)
    elif planted == "another launch":  # same secret, signed for a job of another size
        rendezvous_address(server, secret, ("198.18.0.66", 1), 30, 3)
    else:
        rendezvous_kv.put(server, ADDRESS_KEY, b'{"host": "198.18.0.66", "port": 1}')
    with pytest.raises(RunError, match="without a valid job-secret MAC"):
        rendezvous_address(server, secret, None, 5, 2)


def test_a_missing_value_or_a_dead_server_ends_in_a_clear_error_by_the_deadline(server) -> None:
    with pytest.raises(RunError, match="within 0 s .not put yet"):
        rendezvous_kv.wait_for(server, "never-put", 0.3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = ("127.0.0.1", s.getsockname()[1])  # bound, not listening: connections are refused
        with pytest.raises(RunError, match="within 1 s .*did not answer GET"):
            rendezvous_kv.wait_for(dead, "k", 1.0)


def test_a_rank_whose_environment_disagrees_with_horovod_is_refused() -> None:
    class _Done:
        def result(self):
            return SimpleNamespace(rank=1, size=2), ["a", "b"], {}

    assert channel_startup.joined(_Done(), 1, 2)[1] == ["a", "b"]
    with pytest.raises(RunError, match="say rank 1 of 2, Horovod says 0 of 2"):
        channel_startup.joined(_Done(), 0, 2)


def test_when_hvd_init_fails_after_the_channel_failed_the_channels_error_is_raised() -> None:
    def refused() -> None:
        raise RunError("address refused")

    class _Hvd:
        def init(self) -> None:
            raise ValueError("Horovod initialization failed")

    opening = InBackground(refused)
    with pytest.raises(RunError):
        opening.result()
    with pytest.raises(RunError, match="address refused") as info:
        channel_startup.init_horovod(_Hvd(), opening)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="Horovod initialization failed"):
        channel_startup.init_horovod(_Hvd(), None)


def _run_ranks(argv: list[str], env: dict[str, str], hosts: list[str]) -> list[dict]:
    """One process per entry of ``hosts`` (rank r on ``hosts[r]``) running ``python argv``; the JSON
    each printed last, in rank order, once all ended with status 0."""
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env={**env, "HOROVOD_RANK": str(r), "HOROVOD_HOSTNAME": host},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, host in enumerate(hosts)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    return [json.loads(o[0].strip().splitlines()[-1]) for o in outs]


def test_two_ranks_build_the_channel_from_horovodruns_environment_alone(server) -> None:
    env = {
        **os.environ,
        **auth.secret_env(secrets.token_bytes(32)),
        "HOROVOD_SIZE": "2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": server[0],
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server[1]),
    }
    seen = _run_ranks([str(PROBE)], env, ["site0", "site1"])
    for r, s in enumerate(seen):
        assert s["rank"] == r and s["hosts"] == ["site0", "site1"] and s["gathered"] == [1, 2]
        assert s["phases"] == ["channel_address", "channel_store", "channel_world", "hostnames"]


EARLY = Path(__file__).with_name("mp") / "channel_early_groups.py"


@pytest.mark.parametrize("groups", ["same", "other"])
def test_groups_named_at_launch_connect_beside_the_world_and_are_adopted_only_if_set(server, groups) -> None:
    """Ranks 0, 1 on host A and 2 on host B (the launcher's placement): the groups by host connect
    while the world does; setting those groups adopts them, setting others builds new ones; each
    group's allreduce sums its own members."""
    env = {
        **os.environ,
        **auth.secret_env(secrets.token_bytes(32)),
        "HOROVOD_SIZE": "3",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": server[0],
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server[1]),
        "MEDSEG_RANK_HOSTS": "hostA,hostA,hostB",
    }
    seen = {s["rank"]: s["sums"] for s in _run_ranks([str(EARLY), groups], env, ["hostA", "hostA", "hostB"])}
    if groups == "same":  # groups [0, 1] and [2]; leaders 0 and 2
        assert seen[0] == {"group": ["early-group0-1/", 3.0], "leaders": ["early-leaders/", 4.0]}
        assert seen[1] == {"group": ["early-group0-1/", 3.0]}
        assert seen[2] == {"leaders": ["early-leaders/", 4.0]}
    else:  # groups [0] and [1, 2]; leaders 0 and 1
        assert seen[0] == {"leaders": ["leaders/", 3.0]}
        assert seen[1] == {"group": ["group1-2/", 5.0], "leaders": ["leaders/", 3.0]}
        assert seen[2] == {"group": ["group1-2/", 5.0]}
