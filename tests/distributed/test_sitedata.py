"""Hospitals keep their data: site-local datasets, the audit of what leaves a site, per-site results,
unlike scanners, FedBN's local normalisation.

Multi-rank tests run two sites on this machine under two local host names (``localhost`` and
``127.0.0.1``: horovodrun starts both without ssh, and each rank sees its own ``HOROVOD_HOSTNAME``);
the dropout test on the emulated hospital network is in ``tests/testbed/test_sites.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml

from medseg.config import ConfigError, config_from_dict
from medseg.datasets.synthetic import Scanner, make_seg_dataset
from medseg.distributed.comm.audit import KINDS, Audit, summarize
from medseg.distributed.site_data import compare_facts, horovodrun_hosts, pool_metrics, site_share
from medseg.errors import DataError
from medseg.training.data import path_digest
from tests.conftest import tiny_seg_config

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CANARY = [17, -93, 201, 3, -141, 77, 239, -11, 143, 59, -127, 211]


# -- epochs and rounds with unequal sites --------------------------------------------------------
def test_unequal_sites_each_rank_keeps_its_sites_cases_and_every_case_is_seen_each_epoch() -> None:
    rank_sites = ["a", "a", "b", "c"]
    cases = {"a": 11, "b": 3, "c": 7}
    periods = [2, 2, 1, 1]  # site a's ranks are twice as fast
    b = 2
    shares = [site_share(rank_sites, cases, periods, b, r, seed=5) for r in range(4)]
    # site a's two ranks hold each of a's 11 cases exactly once between them
    assert sorted(shares[0][0] + shares[1][0]) == list(range(11))
    assert shares[2][0] == [0, 1, 2] and shares[3][0] == list(range(7))
    # R = max over ranks of ceil(n_r / (b p_r)) = max(ceil(6/4), ceil(5/4), ceil(3/2), ceil(7/2)) = 4
    assert [per_epoch for _, per_epoch in shares] == [4 * 2 * b, 4 * 2 * b, 4 * 1 * b, 4 * 1 * b]
    # every rank sees each of its own cases at least once per epoch, and all take 4 rounds
    assert all(per_epoch >= len(own) for own, per_epoch in shares)
    with pytest.raises(ConfigError, match="site b: 1 training cases cannot give each of its 2 ranks"):
        site_share(["a", "b", "b"], {"a": 4, "b": 1}, [1, 1, 1], 1, 0, 0)


def test_site_facts_mismatch_names_the_site_and_the_difference() -> None:
    a = {
        "task": "segmentation",
        "labels": {0: "background", 1: "organ"},
        "modality": {"0": "CT"},
        "channels": 1,
    }
    compare_facts({"a": {**a, "train_cases": 4}, "b": {**a, "train_cases": 9}})
    with pytest.raises(
        DataError, match=r"site b: its dataset's labels \{0: background, 1: liver\} differs from site a"
    ):
        compare_facts(
            {
                "a": {**a, "train_cases": 4},
                "b": {**a, "labels": {0: "background", 1: "liver"}, "train_cases": 4},
            }
        )
    with pytest.raises(DataError, match="site c: its dataset's channels 2 differs"):
        compare_facts({"a": {**a, "train_cases": 1}, "c": {**a, "channels": 2, "train_cases": 1}})
    stop = {"stop_at": 0.85, "min_epochs": 2, "val_interval": 1}
    compare_facts(
        {"a": {**a, "train_cases": 1, "stopping": stop}, "b": {**a, "train_cases": 1, "stopping": stop}}
    )
    with pytest.raises(ConfigError, match=r"site b: its train settings \{stop_at: 0.9.*differ from site a's"):
        compare_facts(
            {
                "a": {**a, "train_cases": 1, "stopping": stop},
                "b": {**a, "train_cases": 1, "stopping": {**stop, "stop_at": 0.9}},
            }
        )


def test_hosts_name_sites_and_configs_are_checked(tmp_path: Path) -> None:
    cfg = config_from_dict({"sites": {"a": {"dir": "/x/a", "host": "10.0.0.1"}, "b": {"dir": "/x/b"}}})
    assert horovodrun_hosts(cfg, "a:2,b:2") == ("10.0.0.1:2,b:2", ["a", "b"])
    assert horovodrun_hosts(cfg, "10.0.0.1:1") == ("10.0.0.1:1", ["a"])
    with pytest.raises(ConfigError, match="'z' is not one of the config's sites"):
        horovodrun_hosts(cfg, "a:1,z:1")
    with pytest.raises(ConfigError, match="names a site twice"):
        horovodrun_hosts(cfg, "a:1,10.0.0.1:1")
    with pytest.raises(ConfigError, match="sites.b.dir"):
        config_from_dict({"sites": {"b": {"host": "h"}}})
    with pytest.raises(ConfigError, match="dist.local_norm: bsp"):
        config_from_dict({"dist": {"sync": "bsp", "local_norm": True}})


def test_pooled_scores_weigh_cases() -> None:
    pooled = pool_metrics({"a": {"val_dice": 0.9, "val_cases": 1}, "b": {"val_dice": 0.6, "val_cases": 2}})
    assert pooled["val_dice"] == pytest.approx(0.7)


# -- the audit's canary search ------------------------------------------------------------------
def test_audit_finds_the_canary_in_file_loaded_and_windowed_forms(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEDSEG_AUDIT_CANARY", ",".join(map(str, CANARY)))
    monkeypatch.setenv("MEDSEG_AUDIT_WINDOW", "-150,250")
    audit = Audit(rank=0)
    audit.open(tmp_path / "audit" / "a-rank0.jsonl", ["a", "b"])
    rng = np.random.default_rng(0)
    volume = rng.normal(0, 100, size=500).astype(np.int16)
    volume[100:112] = CANARY
    windowed = np.clip((volume.astype(np.float32) + 150) / 400, 0, 1)
    leaks = {
        "file": volume.tobytes(),
        "loaded": torch.from_numpy(volume.astype(np.float32)),
        "pickled-windowed": b"x" + pickle.dumps({"patch": windowed}),  # odd byte offset
    }
    for payload in leaks.values():
        audit.sent([0, 1], "allgather", "metrics", payload)
    audit.sent([0, 1], "allreduce", "parameters", torch.from_numpy(rng.normal(size=4000).astype(np.float32)))
    audit.sent([0], "allreduce", "gradients", leaks["file"])  # stays in site a: not logged
    audit.close()
    records = [json.loads(line) for line in (tmp_path / "audit" / "a-rank0.jsonl").read_text().splitlines()]
    assert [r["canary"] for r in records] == [True, True, True, False]
    assert all(r["to"] == ["b"] for r in records)
    totals = summarize(tmp_path)
    assert totals["canary_hits"] == 3 and totals["messages"] == 4
    with pytest.raises(ValueError, match="unknown kind 'images'"):
        audit.sent([0, 1], "allgather", "images", b"1234")


# -- unlike scanners ----------------------------------------------------------------------------
def test_scanner_options_change_intensity_geometry_and_orientation_not_anatomy(tmp_path: Path) -> None:
    plain = make_seg_dataset(tmp_path / "p", n_train=1, n_test=0, seed=4, size=32)
    other = Scanner(scale=0.5, offset=-100.0, noise=0.0, spacing=1.0, z_factor=3, orientation="RAS")
    moved = make_seg_dataset(tmp_path / "s", n_train=1, n_test=0, seed=4, size=32, scanner=other)
    img_p = nib.load(plain / "imagesTr" / "synth_000.nii.gz")
    img_s = nib.load(moved / "imagesTr" / "synth_000.nii.gz")
    lab_p = nib.load(plain / "labelsTr" / "synth_000.nii.gz")
    lab_s = nib.load(moved / "labelsTr" / "synth_000.nii.gz")
    assert nib.aff2axcodes(img_s.affine) == ("R", "A", "S") and nib.aff2axcodes(img_p.affine) == (
        "L",
        "P",
        "S",
    )
    assert img_s.header.get_zooms() == pytest.approx((1.0, 1.0, 3.0))
    # the same anatomy in world space: reorienting back to LPS gives the same label array
    tr = nib.orientations.ornt_transform(
        nib.orientations.io_orientation(lab_s.affine), nib.orientations.io_orientation(lab_p.affine)
    )
    assert np.array_equal(
        nib.orientations.apply_orientation(np.asarray(lab_s.dataobj), tr), np.asarray(lab_p.dataobj)
    )
    # air (-1000 HU) after scale 0.5 and offset -100 is -600 HU
    air = np.asarray(img_s.dataobj)[0, 0, 0]
    assert air == pytest.approx(-600, abs=2)
    with pytest.raises(ConfigError, match="orientation 'LLS'"):
        Scanner(orientation="LLS").check()


# -- a two-site job --------------------------------------------------------------------------------
def _two_sites(
    tmp_path: Path, sync: str = "gssp", local_norm: bool = True, epochs: int = 2
) -> tuple[Path, dict]:
    a = make_seg_dataset(tmp_path / "hospA", n_train=5, n_test=0, seed=5, size=32)
    b = make_seg_dataset(
        tmp_path / "hospB",
        n_train=4,
        n_test=0,
        seed=6,
        size=32,
        scanner=Scanner(scale=0.7, offset=-40.0, noise=30.0),
    )
    cfg = tiny_seg_config(
        tmp_path / "nowhere",
        tmp_path / "runs",
        name="sites",
        epochs=epochs,
        batch_size=1,
        threads=1,
        scheduler="none",
    ).to_dict()
    cfg["model"]["norm"] = "batch"
    cfg["data"]["val_fraction"] = 0.25
    cfg["dist"].update({"sync": sync, "timeout_s": 120, "profile_steps": 2, "local_norm": local_norm})
    cfg["sites"] = {"a": {"dir": str(a), "host": "localhost"}, "b": {"dir": str(b), "host": "127.0.0.1"}}
    return a, cfg


def _train(
    tmp_path: Path,
    cfg: dict,
    extra_env: dict | None = None,
    timeout: int = 900,
    args: list[str] | None = None,
) -> subprocess.CompletedProcess:
    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", **(extra_env or {}))
    argv = [
        str(BIN / "medseg"),
        "train",
        "--config",
        str(config),
        "--np",
        "2",
        "--hosts",
        "a:1,b:1",
        *(args or []),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    (tmp_path / "job.log").write_text(proc.stdout + proc.stderr)
    return proc


def _plant_canary(dataset: Path) -> None:
    image = dataset / "imagesTr" / "synth_000.nii.gz"
    img = nib.load(image)
    data = np.asarray(img.dataobj).copy()
    # along x (contiguous in NIfTI's file order and nibabel's Fortran-ordered arrays) and along z
    # (contiguous in C-ordered tensors), so a leak in either memory order holds the whole run
    data[: len(CANARY), 8, 8] = CANARY
    data[16, 16, : len(CANARY)] = CANARY[: data.shape[2]]
    nib.save(nib.Nifti1Image(data, img.affine, img.header), image)


def test_sites_train_on_their_own_data_send_no_image_bytes_and_report_per_site(tmp_path: Path) -> None:
    """Two sites, gssp with local_norm: each rank opens only its site's folder, the audit logs
    every message to the other site (model changes, metrics, headers; no weights, as the initial
    models agree; never the canary planted in site a's images), metrics.jsonl holds per-site and pooled Dice every epoch,
    each site keeps its own BatchNorm statistics, and evaluate prints a sites x metrics table."""
    a, cfg = _two_sites(tmp_path)
    _plant_canary(a)
    proc = _train(
        tmp_path, cfg, {"MEDSEG_AUDIT_CANARY": ",".join(map(str, CANARY)), "MEDSEG_AUDIT_WINDOW": "-150,250"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "sites"
    loaded = {}
    for r in (0, 1):
        for line in (run / "ranks" / f"rank-{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("ev") == "loaded":
                loaded[r] = (rec["site"], rec["data"])
    # the folder each rank opened, as a digest: its path stays on the site (data.share_paths: false)
    assert loaded == {0: ("a", path_digest(a)), 1: ("b", path_digest(Path(cfg["sites"]["b"]["dir"])))}
    # what left each site
    totals = summarize(run)
    assert set(totals["sites"]) == {"a", "b"}
    assert set(totals["kinds"]) <= set(KINDS)
    assert {"model-change", "dataset-header", "metrics"} <= set(totals["kinds"])
    # both ranks built one model from one seed and profiling kept its BatchNorm statistics: no
    # weights cross (gssp's epoch-end average holds only buffers, and local_norm keeps those home)
    assert "parameters" not in totals["kinds"], totals["kinds"]
    assert totals["canary_hits"] == 0, totals
    assert totals["sites"]["b"]["model-change"] > 0 and totals["sites"]["a"]["model-change"] > 0
    # per-site and pooled Dice every epoch
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    for rec in records:
        assert set(rec["sites"]) == {"a", "b"}
        site_dice = [rec["sites"][s]["val_dice"] for s in ("a", "b")]
        weights = [rec["sites"][s]["val_cases"] for s in ("a", "b")]
        assert rec["val_dice"] == pytest.approx(sum(d * w for d, w in zip(site_dice, weights)) / sum(weights))
    # local_norm: each site's BatchNorm statistics are its own; shared weights are one model
    site_local = torch.load(run / "bundle" / "models" / "site_local.pt", weights_only=True)
    means = [k for k in site_local["a"] if k.endswith("running_mean")]
    assert means and not torch.allclose(site_local["a"][means[0]], site_local["b"][means[0]])
    # evaluate: sites against metrics, site b scored with its own normalisation
    out = subprocess.run(
        [
            str(BIN / "medseg"),
            "evaluate",
            "--run",
            str(run),
            "--data",
            f"a={a}",
            "--data",
            f"b={cfg['sites']['b']['dir']}",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    assert rows[1][:2] == ["site", "cases"] and "dice" in rows[1], out.stdout
    assert [r[:2] for r in rows[2:5]] == [["a", "5"], ["b", "4"], ["pooled", "9"]], out.stdout
    result = json.loads((run / "eval-sites.json").read_text())
    dice_a, dice_b = result["sites"]["a"]["dice"], result["sites"]["b"]["dice"]
    assert result["pooled"]["dice"] == pytest.approx((5 * dice_a + 4 * dice_b) / 9, abs=1e-6)


def test_every_rank_stops_early_at_the_same_epoch_from_the_pooled_scores(tmp_path: Path) -> None:
    """With sites every rank receives every site's scores and decides early stopping itself (no
    barrier between epochs): the epoch at which train.stop_at is met is the last one every rank
    trains, the job ends cleanly, and no epoch started with a barrier."""
    _, cfg = _two_sites(tmp_path, local_norm=False, epochs=5)
    # every score meets a negative stop_at (this tiny net's Dice may still be 0), so the stop is due
    # at min_epochs: every rank must stop there from the scores it received, not from a barrier
    cfg["train"].update({"stop_at": -1.0, "min_epochs": 2})
    proc = _train(tmp_path, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "sites"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and set(records[-1]["sites"]) == {"a", "b"}
    for r in (0, 1):
        events = [json.loads(line) for line in (run / "ranks" / f"rank-{r}.jsonl").read_text().splitlines()]
        assert max(e.get("epoch", 0) for e in events) == 2, (r, events[-3:])
    # the barrier that carries rank 0's decision (one int64 per rank, a control allgather) never
    # ran: site b's audit of what it sent site a
    sent = [json.loads(line) for line in (run / "audit" / "b-rank1.jsonl").read_text().splitlines()]
    barriers = [m for m in sent if (m["op"], m["kind"], m["bytes"]) == ("allgather", "control", 8)]
    assert not barriers, barriers


@pytest.mark.parametrize("min_epochs", [2, 1])
def test_ranks_start_the_next_epoch_before_its_scores_arrive_unless_a_stop_can_follow(
    tmp_path: Path, min_epochs: int
) -> None:
    """Before train.min_epochs no stop can follow an epoch, so every rank starts the next one without
    waiting for the epoch's message (scores and numbers): with site b's first validation 6 s slow,
    site a's first step of epoch 2 comes before epoch 1's scores arrive (its record's time). Where a
    stop can follow epoch 1 (min_epochs 1), the message comes first. Every epoch is recorded."""
    _, cfg = _two_sites(tmp_path, local_norm=False, epochs=2)
    cfg["train"].update({"stop_at": 2.0, "min_epochs": min_epochs})  # a Dice of 2 is never reached
    proc = _train(tmp_path, cfg, {"MEDSEG_FAULT_SLOW": "validate:1:6"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "sites"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    assert all(set(r["sites"]) == {"a", "b"} and "val_dice" in r for r in records)
    events = [json.loads(line) for line in (run / "ranks" / "rank-0.jsonl").read_text().splitlines()]
    epoch2 = next(e["t"] for e in events if e.get("epoch") == 2 and e.get("step") == 0)
    scores1 = records[0]["time"]
    assert (epoch2 < scores1) if min_epochs == 2 else (epoch2 > scores1), (epoch2, scores1)


@pytest.mark.parametrize("sync", ["gssp", "fedavg"])
def test_a_site_whose_dataset_differs_stops_the_job_before_training(tmp_path: Path, sync: str) -> None:
    """With or without profiling the ranks (gssp does, fedavg does not), the job stops before any step."""
    _, cfg = _two_sites(tmp_path, sync=sync, local_norm=False)
    meta_path = Path(cfg["sites"]["b"]["dir"]) / "dataset.json"
    meta = json.loads(meta_path.read_text())
    meta["labels"] = {"0": "background", "1": "liver", "2": "lesion"}
    meta_path.write_text(json.dumps(meta))
    proc = _train(tmp_path, cfg)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    message = proc.stderr.split("error:")[-1]
    assert (
        "site b" in message and "labels" in message and "liver" in message and "Traceback" not in message
    ), message
    assert not (tmp_path / "runs" / "sites" / "checkpoints").exists()


def test_a_site_whose_rank_dies_is_dropped_and_below_min_sites_the_job_stops(tmp_path: Path) -> None:
    """Site b's rank is killed after the first checkpoint; with --min-sites 2 one site is too few:
    exit 2 naming the lost site (the cut-and-carry-on case is in tests/testbed/test_sites.py)."""
    import signal
    import time

    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")
    _, cfg = _two_sites(tmp_path, sync="gssp", local_norm=False, epochs=30)
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    argv = [str(BIN / "medseg"), "train", "--config", str(config), "--np", "2", "--hosts", "a:1,b:1"]
    argv += ["--max-restarts", "2", "--min-sites", "2"]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    run = tmp_path / "runs" / "sites"
    try:
        deadline = time.time() + 900
        while not (run / "checkpoints" / "last.pt").exists():
            assert job.poll() is None and time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.5)
        pid = next(
            json.loads(line)["pid"]
            for line in (run / "ranks" / "rank-1.jsonl").read_text().splitlines()
            if '"started"' in line
        )
        os.kill(pid, signal.SIGKILL)
        out, err = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    (tmp_path / "job.log").write_text(out + err)
    assert job.returncode == 2, err[-3000:]
    message = err.split("error:")[-1]
    assert "rank 1" in message and "Site b is lost" in message and "fewer than --min-sites 2" in message, (
        message
    )
    assert "Traceback" not in message
