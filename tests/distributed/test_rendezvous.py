"""Horovod's HTTP rendezvous server, as medseg's launcher starts it (``distributed/launch/hvdrun.py``):
it listens only on the address the ranks are given, and refuses a PUT that claims a huge or
malformed body before reading it. The rank's probe reads the kernel's socket table itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from medseg.distributed.launch.launcher import horovodrun_command

PROBE = Path(__file__).with_name("mp") / "rendezvous_probe.py"


def _hex_ipv4(addr: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (little-endian hex)."""
    return "".join(f"{int(x):02X}" for x in reversed(addr.split(".")))


def test_rendezvous_listens_on_the_ranks_address_only_and_bounds_a_put() -> None:
    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    cmd = [*horovodrun_command(), "-np", "1", "-H", "localhost:1", "--gloo", sys.executable, str(PROBE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[0]<stdout>:{"))
    seen = json.loads(line.split(":", 1)[1])
    assert seen["bound"] == [_hex_ipv4(seen["addr"])], seen  # not 00000000 (every interface)
    assert seen["huge"] == 413 and seen["bad"] == 413, seen
    assert seen["ok"] == 200, seen
