"""The launcher's own pieces around horovodrun: its build check moved to the ranks, and how a rank ends."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_hvdrun_leaves_the_gloo_check_to_the_ranks(monkeypatch) -> None:
    """Horovod's own run_controller, reached through hvdrun, launches without forking the build check."""
    from horovod.common import util
    from horovod.runner import launch

    from medseg.distributed.launch.launcher import horovodrun_command

    cmd = horovodrun_command()
    assert cmd[0] == sys.executable and Path(cmd[1]).name == "hvdrun.py"
    spec = importlib.util.spec_from_file_location("hvdrun_under_test", cmd[1])
    hvdrun = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hvdrun)

    def forked(*args, **kwargs):
        raise AssertionError("horovodrun's per-launch build check ran")

    monkeypatch.setattr(util, "_check_extension_lambda", forked)
    monkeypatch.setattr(launch, "gloo_built", launch.gloo_built)  # undone after the test
    launched: list[bool] = []
    monkeypatch.setattr(
        launch,
        "run_commandline",
        lambda: launch.run_controller(True, lambda: launched.append(True), False, None, False, None, None),
    )
    assert hvdrun.main() == 0
    assert launched == [True]


def test_a_rank_without_gloo_is_refused_with_what_to_do(monkeypatch) -> None:
    import horovod.torch as hvd

    from medseg.config import config_from_dict
    from medseg.distributed.session import HorovodSession
    from medseg.errors import RunError

    cfg = config_from_dict({"name": "x", "task": "segmentation", "dist": {"sync": "bsp"}})
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "198.18.1.1")
    monkeypatch.setattr(hvd, "gloo_built", lambda: False)
    with pytest.raises(RunError, match="built without Gloo.*make setup"):
        HorovodSession(cfg)


def test_end_rank_flushes_what_the_rank_printed_and_exits_0() -> None:
    """Output to a pipe is block-buffered: without the flush, os._exit would drop it."""
    script = (
        "import logging, sys\n"
        "from medseg.distributed.launch.launcher import end_rank\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='%(message)s')\n"
        "print('last line on stdout')\n"
        "logging.getLogger('medseg').info('last log record')\n"
        "end_rank()\n"
        "print('never printed')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as by default
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "last line on stdout\n"
    assert "last log record" in proc.stderr
