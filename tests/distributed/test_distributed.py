"""Multi-rank training through Horovod's own launcher (Gloo on CPU), 2 and 4 ranks."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (scripts/build_horovod.sh)")

from medseg.checkpoint import load_checkpoint  # noqa: E402
from medseg.training.runlog import read_metrics  # noqa: E402
from tests.conftest import tiny_seg_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def horovodrun(np_: int, script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    # a plain horovodrun line (no launcher): the ranks' channel needs a job secret all the same
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", MEDSEG_JOB_SECRET=secrets.token_hex(32))
    cmd = [
        str(BIN / "horovodrun"),
        "-np",
        str(np_),
        "-H",
        f"localhost:{np_}",
        "--gloo",
        sys.executable,
        str(ROOT / script.split()[0]),
        *script.split()[1:],
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def write_config(tmp_path: Path, data: Path, name: str, dist: dict, epochs: int = 3) -> Path:
    """The tiny UNet of conftest, one volume per batch and rank, one thread per rank."""
    cfg = tiny_seg_config(
        data, tmp_path / "runs", name=name, epochs=epochs, batch_size=1, threads=1, scheduler="none"
    )
    cfg = cfg.to_dict()
    cfg["dist"].update({"timeout_s": 60, "profile_steps": 3, **dist})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def medseg(*args: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", **(env or {}))
    return subprocess.run(
        [str(BIN / "medseg"), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.fixture(scope="module")
def dist_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from medseg.datasets.synthetic import make_seg_dataset

    return make_seg_dataset(tmp_path_factory.mktemp("dist") / "seg", n_train=16, n_test=0, seed=5, size=48)


@pytest.mark.parametrize("np_", [2, 4])
def test_gssp_one_group_staleness_zero_equals_plain_horovod(np_: int) -> None:
    proc = horovodrun(np_, "tests/distributed/mp/gssp_equals_bsp.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "relative parameter difference" in proc.stdout


def test_gssp_fixed4_trains_like_bsp_and_keeps_the_staleness_bound(dist_data: Path, tmp_path: Path) -> None:
    bsp = write_config(tmp_path, dist_data, "bsp", {"sync": "bsp"})
    # rounds of one step each (periods [1, 1]): three rounds per epoch, so rounds are applied inside
    # the epoch and the steps' records carry τ. Measured periods follow the machine's load: [3, 1]
    # gives one round per epoch, applied only at its end, and no τ in any step.
    fixed4 = {"sync": "gssp", "groups": [[0, 1], [2, 3]], "staleness": 1, "compression": "fixed", "bits": 4}
    gssp = write_config(tmp_path, dist_data, "gssp4", {**fixed4, "periods": [1, 1]})
    # the bsp ranks print every module file they execute (Python's verbose mode, on their stderr,
    # which horovodrun prefixes with the rank): none of launcher.UNUSED_IN_RANKS may be among them
    proc = medseg(
        "train", "--config", str(bsp), "--np", "4", env={"PYTHONVERBOSE": "1", "MEDSEG_STRAGGLER": "3:2"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loaded = [line for line in proc.stdout.splitlines() if "<stderr>:# code object from" in line]
    assert {line.split("<stderr>", 1)[0] for line in loaded if "/site-packages/monai/" in line} == {
        "[0]",
        "[1]",
        "[2]",
        "[3]",
    }
    unused = ("/site-packages/ignite/", "/site-packages/pandas/", "/site-packages/scipy/signal/")
    assert not [line for line in loaded if any(u in line for u in unused)][:3]
    # matplotlib (launcher.UNUSED_IN_OTHER_RANKS): rank 0 plots the learning curve, the others never load it
    plots = {line.split("<stderr>", 1)[0] for line in loaded if "/site-packages/matplotlib/" in line}
    assert plots == {"[0]"}, plots
    proc = medseg("train", "--config", str(gssp), "--np", "4", env={"MEDSEG_STRAGGLER": "3:2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = read_metrics(tmp_path / "runs" / "bsp" / "metrics.jsonl")
    b = read_metrics(tmp_path / "runs" / "gssp4" / "metrics.jsonl")
    assert [r["epoch"] for r in b] == [1, 2, 3]
    assert b[-1]["dist_groups"] == [[0, 1], [2, 3]]
    assert b[-1]["val_dice"] >= a[-1]["val_dice"] - 0.05, (a[-1]["val_dice"], b[-1]["val_dice"])
    assert max(r["dist_max_staleness"] for r in b) <= 1
    steps = [
        json.loads(line)
        for r in range(4)
        for line in (tmp_path / "runs" / "gssp4" / "ranks" / f"rank-{r}.jsonl").read_text().splitlines()
    ]
    seen = [s["staleness"] for s in steps if s.get("staleness") is not None]
    assert seen and max(seen) <= 1
    assert b[-1]["dist_bytes_per_step"] < a[-1]["dist_bytes_per_step"]
    assert (tmp_path / "runs" / "gssp4" / "bundle" / "models" / "model.pt").is_file()
    assert not list((tmp_path / "runs" / "gssp4").glob("checkpoints/.*"))  # no half-written files


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.5)


def _rank_pid(run: Path, rank: int) -> int:
    """The pid a rank reported to the launcher in its first heartbeat record."""
    for line in (run / "ranks" / f"rank-{rank}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("ev") == "started":
            return int(rec["pid"])
    raise AssertionError(f"rank {rank} never reported its pid")


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_dead_or_hung_rank_stops_the_job_naming_it(dist_data: Path, tmp_path: Path, fault: str) -> None:
    config = write_config(tmp_path, dist_data, "faulty", {"sync": "bsp", "timeout_s": 20}, epochs=30)
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    job = subprocess.Popen(
        [str(BIN / "medseg"), "train", "--config", str(config), "--np", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    run = tmp_path / "runs" / "faulty"
    try:
        _wait_for(run / "checkpoints" / "last.pt", 480)  # start-up on a busy 2-core machine
        pid = _rank_pid(run, 1)
        tic = time.time()
        os.kill(pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        out, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 2, err[-2000:]
    assert "rank 1" in err and "Traceback" not in err.split("error:")[-1], err[-3000:]
    assert time.time() - tic < 20 + 60
    epoch = load_checkpoint(run / "checkpoints" / "last.pt")["epoch"]  # intact: loads with weights_only
    assert epoch >= 1
    proc = medseg("train", "--config", str(config), "--np", "2", "--resume", "train.epochs=" + str(epoch + 1))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert read_metrics(run / "metrics.jsonl")[-1]["epoch"] == epoch + 1


def test_gssp_and_local_sgd_equal_their_single_process_replays() -> None:
    """Two groups, s = 1, real staleness: the engines land on what a one-process replay of their logs computes."""
    proc = horovodrun(2, "tests/distributed/mp/gssp_replay.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "FAIL " not in out, out[-4000:]
    assert out.count("PASS ") == 20, out[-4000:]


def test_gssp_with_unequal_local_steps_converges_to_the_sample_weighted_optimum() -> None:
    """Two sites' quadratics, 3 and 1 steps per round: normalised rounds (FedNova) land on Σ c_h m_h
    within 1e-3; the plain mean, run the same way, does not (it leans to the site taking more steps)."""
    proc = horovodrun(2, "tests/distributed/mp/gssp_fednova.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS gssp normalised" in out, out[-3000:]
    plain = horovodrun(2, "tests/distributed/mp/gssp_fednova.py --plain")
    out = plain.stdout + plain.stderr
    assert "FAIL gssp plain mean" in out, out[-3000:]


def _model_of(path: Path) -> dict:
    return load_checkpoint(path)["model"]


def test_compressed_gssp_resume_equals_the_uninterrupted_run(dist_data: Path, tmp_path: Path) -> None:
    """Two groups with 4-bit rounds (an error-feedback residual per rank): stop after epoch 1, resume, and
    land on the uninterrupted run's parameters, because every rank's residuals are kept with the checkpoint."""
    dist = {
        "sync": "gssp",
        "groups": [[0], [1]],
        "periods": [1, 1],
        "staleness": 0,
        "compression": "fixed",
        "bits": 4,
    }
    whole = write_config(tmp_path, dist_data, "whole", dist, epochs=2)
    parts = write_config(tmp_path, dist_data, "parts", dist, epochs=1)
    for args in (
        ["--config", str(whole)],
        ["--config", str(parts)],
        ["--config", str(parts), "--resume", "train.epochs=2"],
    ):
        proc = medseg("train", *args, "--np", "2")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = load_checkpoint(tmp_path / "runs" / "parts" / "checkpoints" / "last.pt")
    assert state["epoch"] == 2 and state["dist"] == {"epoch": 2, "ranks": 2}
    # each rank's residual is kept beside it, not sent to rank 0: rank 1's too, for this epoch
    shard = load_checkpoint(tmp_path / "runs" / "parts" / "checkpoints" / "sync" / "r1-e2.pt")
    assert shard["epoch"] == 2 and shard["state"]["delta"]
    a, b = _model_of(tmp_path / "runs" / "whole" / "checkpoints" / "last.pt"), state["model"]
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert diff <= 1e-6, diff


def test_measured_lead_respects_the_bound_and_exceeds_it_when_the_bound_is_off(
    dist_data: Path, tmp_path: Path
) -> None:
    """The lead is measured from the leaders' timestamped records, not read from the schedule: with the bound
    switched off (s = 50) a 3x faster group runs several rounds ahead; with s = 1 it never leads by more than 1."""
    from medseg.bench.sites_figures import max_lead_rounds, rank_records

    leads = {}
    for s in (1, 50):
        dist = {"sync": "gssp", "groups": [[0], [1]], "periods": [1, 1], "staleness": s}
        config = write_config(tmp_path, dist_data, f"lead{s}", dist, epochs=1)
        proc = medseg("train", "--config", str(config), "--np", "2", env={"MEDSEG_STRAGGLER": "1:3"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        leads[s] = max_lead_rounds(rank_records(tmp_path / "runs" / f"lead{s}"))
    assert leads[1] is not None and leads[1] <= 1, leads
    assert leads[50] > 1, leads


def test_long_loading_and_validation_never_trip_the_watchdog(dist_data: Path, tmp_path: Path) -> None:
    """Rank 1 loads for 3x dist.timeout_s and rank 0 validates for 3x dist.timeout_s: both stay alive
    (heartbeats with their phase), so the job finishes; the watchdog only stops silent or stuck ranks."""
    config = write_config(tmp_path, dist_data, "slow", {"sync": "bsp", "timeout_s": 15}, epochs=2)
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", MEDSEG_FAULT_SLOW="load:1:45,validate:0:45")
    proc = subprocess.run(
        [str(BIN / "medseg"), "train", "--config", str(config), "--np", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fault injection: rank 1 spends 45 s more in load" in proc.stdout + proc.stderr
    assert [r["epoch"] for r in read_metrics(tmp_path / "runs" / "slow" / "metrics.jsonl")] == [1, 2]


def test_a_bad_case_in_a_multi_rank_job_is_named_by_the_rank_that_loads_it(
    dist_data: Path, tmp_path: Path
) -> None:
    """Each rank checks only its own cases' files (medseg.training.data.make_train_data); every case is some
    rank's, so a bad label map stops the job with its name, exit 2, and no run folder left behind."""
    import shutil

    import nibabel as nib
    import numpy as np

    from medseg.datasets.nifti import save_nifti
    from medseg.training.data import read_dataset

    bad = tmp_path / "bad"
    shutil.copytree(dist_data, bad)
    cfg_path = write_config(tmp_path, bad, "badcase", {"sync": "bsp"})
    from medseg.config import load_config

    _, train_items, _ = read_dataset(load_config(cfg_path, []))
    label = Path(train_items[-1]["label"])  # not the first case: that one is checked by every rank
    img = nib.load(label)
    save_nifti(np.asarray(img.dataobj)[:-2], img.affine, label)
    proc = medseg("train", "--config", str(cfg_path), "--np", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"{label.name}: label shape" in out, out[-3000:]
    assert not (tmp_path / "runs" / "badcase" / "checkpoints").exists()
