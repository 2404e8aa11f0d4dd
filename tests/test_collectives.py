"""CompressedAllreduce across real Horovod workers (Gloo, CPU): runs tests/mp/compressed_allreduce.py."""

from __future__ import annotations

import os
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
