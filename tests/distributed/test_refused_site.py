"""A site whose update the others refuse, in a real two-site job: it is named, nothing of its update
is applied or saved, and the job either stops (exit 2) or, with ``--max-restarts``, goes on without
that site from the checkpoint written before the update.

Site b's rank spoils its own model at the first step of epoch 2 (``MEDSEG_FAULT_POISON``, the
testbed's emulation seam), so its next cross-site round is 1000 times an honest one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.distributed.test_sitedata import _train, _two_sites

POISON = {"MEDSEG_FAULT_POISON": "1:2:x1000"}


def _epochs(run: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True, map_location="cpu")
    return {k: v for k, v in state["model"].items() if v.is_floating_point()}


def test_a_refused_site_stops_the_job_and_its_update_reaches_no_checkpoint(tmp_path: Path) -> None:
    _, cfg = _two_sites(tmp_path, sync="gssp", local_norm=False, epochs=3)
    proc = _train(tmp_path, cfg, POISON)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    message = proc.stderr.split("error:")[-1]
    assert "rank 1 (site b)" in message and "was refused" in message and "Traceback" not in message, message
    run = tmp_path / "runs" / "sites"
    assert _epochs(run) == [1]  # epoch 2 never finished: its checkpoint was not written
    weights = _weights(run)
    assert all(bool(torch.isfinite(v).all()) for v in weights.values())
    largest = max(float(v.abs().max()) for v in weights.values())
    assert largest < 100, f"a parameter of {largest:g}: the 1000x update reached the checkpoint"


def test_with_max_restarts_the_job_goes_on_without_the_refused_site(tmp_path: Path) -> None:
    _, cfg = _two_sites(tmp_path, sync="gssp", local_norm=False, epochs=3)
    proc = _train(tmp_path, cfg, POISON, args=["--max-restarts", "1"])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "site b dropped out" in log and "rank 1 (site b): its cross-site round was refused" in log, log[
        -4000:
    ]
    run = tmp_path / "runs" / "sites"
    assert _epochs(run) == [1, 2, 3]
    weights = _weights(run)
    assert all(bool(torch.isfinite(v).all()) for v in weights.values())
    assert max(float(v.abs().max()) for v in weights.values()) < 100
    # the restart ran site a alone: its ranks' records name no other site
    sites = {
        json.loads(line).get("site") for line in (run / "ranks" / "rank-0.jsonl").read_text().splitlines()
    }
    assert sites - {None} == {"a"}, sites
