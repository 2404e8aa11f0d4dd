"""The channel's store address through Horovod's own rendezvous server (the one ``horovodrun --gloo``
starts), so the channel can be built while ``hvd.init()`` runs: the address arrives signed, a
forged or foreign-secret value is refused, a proxy in the environment is never used, and two ranks
build a working channel from horovodrun's environment alone."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest

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
    monkeypatch.setenv("http_proxy", "http://198.18.0.9:9")  # a dead proxy: requests must not use it
    monkeypatch.setenv("HTTP_PROXY", "http://198.18.0.9:9")
    secret = secrets.token_bytes(32)
    got: list[tuple[str, int]] = []
    reader = threading.Thread(target=lambda: got.append(rendezvous_address(server, secret, None, 30)))
    reader.start()  # asks first: 404s until rank 0 puts the address
    assert rendezvous_address(server, secret, ("198.18.0.1", 4321), 30) == ("198.18.0.1", 4321)
    reader.join(timeout=30)
    assert got == [("198.18.0.1", 4321)]


def test_a_forged_or_foreign_address_is_refused_and_a_missing_one_times_out(server) -> None:
    secret = secrets.token_bytes(32)
    rendezvous_address(server, secrets.token_bytes(32), ("198.18.0.66", 1), 30)  # another job's secret
    with pytest.raises(RunError, match="without a valid job-secret MAC"):
        rendezvous_address(server, secret, None, 5)
    rendezvous_kv.put(server, ADDRESS_KEY, b'{"host": "198.18.0.66", "port": 1}')  # unsigned
    with pytest.raises(RunError, match="without a valid job-secret MAC"):
        rendezvous_address(server, secret, None, 5)
    with pytest.raises(RunError, match="within 0 s"):
        rendezvous_kv.wait_for(server, "never-put", 0.3)


def test_two_ranks_build_the_channel_from_horovodruns_environment_alone(server) -> None:
    env = {
        **os.environ,
        **auth.secret_env(secrets.token_bytes(32)),
        "HOROVOD_SIZE": "2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": server[0],
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server[1]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROBE)],
            env={**env, "HOROVOD_RANK": str(r), "HOROVOD_HOSTNAME": f"site{r}"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    seen = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    for r, s in enumerate(seen):
        assert s["rank"] == r and s["hosts"] == ["site0", "site1"] and s["gathered"] == [1, 2]
        assert s["phases"] == ["channel_address", "channel_store", "channel_world", "hostnames"]
