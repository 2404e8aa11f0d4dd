"""What leaves a site, in every synchronisation mode: a run of voxel values planted in site a's
images is searched in every buffer a rank hands to another site (medseg's channel and Horovod's
buffers alike) and in the rank output the launcher receives; the site's folder and case names are
searched there and in the records the launcher's heartbeat server received.

The gssp + local_norm job with per-site reports is ``test_sitedata.py``'s; here each mode trains one
epoch on the same two sites.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from medseg.distributed.comm.audit import Audit, canary_in_text, summarize
from tests.distributed.test_sitedata import CANARY, _plant_canary, _train, _two_sites

WINDOW = (-150.0, 250.0)
CANARY_ENV = {"MEDSEG_AUDIT_CANARY": ",".join(map(str, CANARY)), "MEDSEG_AUDIT_WINDOW": "-150,250"}
MODES = {
    "bsp": {"sync": "bsp"},
    "bsp-fixed4": {"sync": "bsp", "compression": "fixed", "bits": 4},
    "local-sgd": {"sync": "local-sgd", "period": 2},
    "ssp": {"sync": "ssp", "staleness": 1},
    "gssp-fixed4": {"sync": "gssp", "compression": "fixed", "bits": 4},
}


def test_a_gradient_horovod_sends_is_searched_before_it_is_sent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The tensor hook bsp installs (Audit.inspect) flags the next Horovod message whose gradient held the run."""
    for k, v in CANARY_ENV.items():
        monkeypatch.setenv(k, v)
    audit = Audit(rank=0)
    audit.open(tmp_path / "audit" / "a-rank0.jsonl", ["a", "b"])
    w = torch.zeros(64, requires_grad=True)
    w.register_hook(audit.inspect)
    for leak in (False, True):
        target = torch.zeros(64)
        if leak:
            target[10 : 10 + len(CANARY)] = torch.tensor(CANARY, dtype=torch.float32)
        (w * target).sum().backward()  # the gradient is ``target``
        audit.sent_modelled([0, 1], "horovod-allreduce", "gradients", 256, "float32")
        w.grad = None
    audit.close()
    assert summarize(tmp_path)["canary_hits"] == 1


def test_printed_runs_are_found_as_text() -> None:
    windowed = np.clip((np.asarray(CANARY, np.float32) - WINDOW[0]) / (WINDOW[1] - WINDOW[0]), 0, 1)
    assert canary_in_text(f"values {CANARY}", CANARY)
    assert canary_in_text(f"tensor({windowed.tolist()})", CANARY, WINDOW)
    assert canary_in_text(str(np.asarray(CANARY, np.float64)), CANARY)
    assert not canary_in_text(f"values {CANARY[:-1]} 0", CANARY)
    assert not canary_in_text(" ".join(str(round(x)) for x in windowed), CANARY, WINDOW)  # 0/1 say nothing


@pytest.mark.parametrize("mode", list(MODES))
def test_no_voxel_file_name_or_folder_of_a_site_leaves_it(mode: str, tmp_path: Path) -> None:
    a, cfg = _two_sites(tmp_path, sync=MODES[mode]["sync"], local_norm=False, epochs=1)
    cfg["dist"].update(MODES[mode])
    _plant_canary(a)
    proc = _train(tmp_path, cfg, CANARY_ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    totals = summarize(tmp_path / "runs" / "sites")
    assert totals["canary_hits"] == 0, totals
    assert totals["messages"] > 0 and {"gradients", "model-change", "parameters"} & set(totals["kinds"]), (
        totals
    )
    # every rank's output as the launcher received it, and the records its heartbeat server kept
    reports = "".join(p.read_text() for p in sorted((tmp_path / "runs" / "sites" / "ranks").glob("*.jsonl")))
    assert '"ev": "loaded"' in reports
    forwarded = proc.stdout + proc.stderr + reports
    assert not canary_in_text(forwarded, CANARY, WINDOW)
    names = sorted(p.name.split(".")[0] for p in (a / "imagesTr").iterdir())
    for private in (str(a), str(cfg["sites"]["b"]["dir"]), *names):
        assert private not in forwarded, f"{private!r} is in the rank output the launcher received"
