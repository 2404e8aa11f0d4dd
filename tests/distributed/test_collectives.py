"""CompressedAllreduce across real Horovod workers (Gloo, CPU): runs tests/distributed/mp/compressed_allreduce.py."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "mp" / "compressed_allreduce.py"
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def _horovod_missing() -> str | None:
    try:
        import horovod.torch  # noqa: F401
    except ImportError as exc:
        return f"horovod.torch cannot be imported ({exc}); `make setup` builds it"
    if not HOROVODRUN.exists():
        return f"{HOROVODRUN} not found beside the Python running the tests"
    return None


@pytest.mark.skipif(_horovod_missing() is not None, reason=str(_horovod_missing()))
@pytest.mark.parametrize("n", [2, 4])
def test_compressed_allreduce_multi_rank(n: int) -> None:
    env = dict(os.environ)
    # horovodrun starts the workers as `python ...` through PATH: make that this venv's Python.
    env["PATH"] = f"{HOROVODRUN.parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(HOROVODRUN), "-np", str(n), "-H", f"localhost:{n}", "--gloo", "python", str(SCRIPT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    passed = [line for line in output.splitlines() if "PASS " in line]
    assert not [line for line in output.splitlines() if "FAIL " in line], output[-6000:]
    # 3 checks x 3 widths (global), 3 x 3 (steps), 1M model, singleton set, non-member; 3 x 3 on pairs for N=4
    assert len(passed) == (30 if n == 4 else 21), output[-6000:]


HIER_SCRIPT = Path(__file__).parent / "mp" / "hier_allreduce.py"


@pytest.mark.skipif(_horovod_missing() is not None, reason=str(_horovod_missing()))
@pytest.mark.parametrize(("sites", "reduction"), [("0,1/2,3", 11), ("0,1/2", 9)])
def test_hierarchical_compressed_allreduce_multi_rank(sites: str, reduction: int) -> None:
    """2 sites x 2 ranks, and unequal sites (2 + 1): bit-identical results on every rank, the
    error-feedback invariant shard by shard, LAN/WAN bytes = the formula, WAN bytes about 1/12 of
    float32 ring allreduce's."""
    n = len(sites.replace("/", ",").split(","))
    env = dict(os.environ, MEDSEG_JOB_SECRET=secrets.token_hex(32))  # the channel's store values carry MACs
    env["PATH"] = f"{HOROVODRUN.parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(HOROVODRUN), "-np", str(n), "-H", f"localhost:{n}", "--gloo", "python", str(HIER_SCRIPT)]
    proc = subprocess.run([*cmd, sites, str(reduction)], env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert not [line for line in output.splitlines() if "FAIL " in line], output[-6000:]
    passed = [line for line in output.splitlines() if "PASS " in line]
    assert len(passed) == 6, output[-6000:]


STAR_SCRIPT = Path(__file__).parent / "mp" / "star_and_model.py"


@pytest.mark.skipif(_horovod_missing() is not None, reason=str(_horovod_missing()))
def test_star_allgather_and_initial_model_agreement_multi_rank() -> None:
    """3 ranks: the small allgather (a star through member 0) equals Gloo's ring allgather; models
    from one seed agree without a broadcast, models from different seeds become rank 0's."""
    env = dict(os.environ, MEDSEG_JOB_SECRET=secrets.token_hex(32))
    env["PATH"] = f"{HOROVODRUN.parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(HOROVODRUN), "-np", "3", "-H", "localhost:3", "--gloo", "python", str(STAR_SCRIPT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert not [line for line in output.splitlines() if "FAIL " in line], output[-6000:]
    passed = [line for line in output.splitlines() if "PASS " in line]
    assert len(passed) == 5, output[-6000:]
