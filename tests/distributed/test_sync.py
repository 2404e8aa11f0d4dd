"""Single-process checks of the synchronisation maths (no Horovod needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from medseg.distributed.launch.heartbeat import RankState, Watchdog
from medseg.distributed.sync.gssp import dc_compensate


@pytest.mark.parametrize("seed", range(5))
def test_dc_asgd_brings_a_stale_update_closer_to_the_fresh_one(seed: int) -> None:
    """On f(w) = ½ wᵀHw (H diagonal, known), a change computed at w_then and applied at w_now.

    The fresh change at w_now is −η H w_now; the stale one is −η H w_then. DC-ASGD approximates
    H by λ g⊙g; with λ fitted to this H in least squares, the compensated change must land closer
    to the fresh change than the stale one does (and the sign-flipped variant farther).
    """
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(64, generator=g, dtype=torch.float64) * 3 + 0.5
    w_then = torch.randn(64, generator=g, dtype=torch.float64)
    w_now = w_then + 0.05 * torch.randn(64, generator=g, dtype=torch.float64)
    lr = 0.1
    grad_then = h * w_then
    lam = float((h * grad_then**2).sum() / (grad_then**4).sum())  # best λ with λ g² ≈ H
    stale, fresh = -lr * grad_then, -lr * h * w_now
    compensated = dc_compensate(stale, w_now, w_then, lam, lr)
    assert torch.allclose(compensated, -lr * (grad_then + lam * grad_then**2 * (w_now - w_then)))
    assert (compensated - fresh).norm() < (stale - fresh).norm()
    flipped = stale + (lam / lr) * stale * stale * (w_now - w_then)  # the opposite sign
    assert (flipped - fresh).norm() > (stale - fresh).norm()


def test_dc_asgd_off_is_identity() -> None:
    d = torch.randn(10)
    assert dc_compensate(d, torch.randn(10), torch.randn(10), 0.0, 0.1) is d


def _state(phase: str, last_seen: float, last_step: float = 0.0, since: float = 0.0) -> RankState:
    return RankState(
        host="h", phase=phase, first_seen=0.0, last_seen=last_seen, phase_since=since, last_step=last_step
    )


def test_watchdog_names_a_silent_rank_and_spares_long_phases() -> None:
    dog = Watchdog(np_=2, timeout_s=20.0, started=0.0)
    # rank 0 validates for 10 minutes while rank 1 waits for it: both alive, nobody is hung
    states = {0: _state("validate", 600.0, since=5.0), 1: _state("wait", 600.0, since=5.0)}
    assert dog.verdict(states, now=601.0) is None
    # a rank loading data for 10 minutes is alive, not hung
    states = {0: _state("load", 600.0, since=1.0), 1: _state("wait", 600.0, since=2.0)}
    assert dog.verdict(states, now=601.0) is None
    # rank 1 falls silent (frozen, killed, cut off)
    states = {0: _state("train", 600.0, last_step=590.0), 1: _state("train", 570.0, last_step=560.0)}
    assert "rank 1" in (dog.verdict(states, now=601.0) or "")
    # both alive and training, but no step for longer than the timeout: the oldest step is named
    states = {0: _state("train", 600.0, last_step=570.0), 1: _state("train", 600.0, last_step=560.0)}
    assert "rank 1" in (dog.verdict(states, now=601.0) or "")
    assert dog.verdict(states, now=585.0) is None
    # a rank that never reports within the start-up grace period
    assert "rank 1 never reported" in (dog.verdict({0: _state("train", 600.0)}, now=601.0) or "")


def test_watchdog_names_the_frozen_rank_not_the_one_waiting_for_it() -> None:
    """A rank frozen after its last step still beat once more; the rank waiting in the collective
    finished that step a moment earlier. Before the frozen rank's silence reaches the timeout, the
    no-progress rule must not name the waiting rank (a race CI hit)."""
    dog = Watchdog(np_=2, timeout_s=20.0, started=0.0)
    states = {0: _state("train", 120.0, last_step=100.0), 1: _state("train", 101.5, last_step=100.1)}
    assert dog.verdict(states, now=120.2) is None  # rank 1 silent for 18.7 s: not yet
    assert "rank 1" in (dog.verdict(states, now=121.6) or "")


def test_max_lead_rounds_from_timestamps() -> None:
    from medseg.bench.sites_figures import max_lead_rounds

    # group of rank 0 submits rounds at t = 1, 2, 3, 4; the slow group (rank 2) at t = 2.5, 5
    fast = [{"ev": "submit", "round": k, "t": float(k + 1)} for k in range(4)]
    fast += [{"ev": "start", "round": k + 1, "t": k + 1.1} for k in range(4)]
    slow = [{"ev": "submit", "round": 0, "t": 2.5}, {"ev": "start", "round": 1, "t": 2.6}]
    slow += [{"ev": "submit", "round": 1, "t": 5.0}, {"ev": "start", "round": 2, "t": 5.1}]
    # at t = 4.1 the fast group has completed 4 rounds, the slow one 1: a lead of 3
    assert max_lead_rounds({0: fast, 2: slow}) == 3
    assert max_lead_rounds({0: fast}) is None  # one group: nothing to lead


def test_training_curve_excludes_validation_and_start_up() -> None:
    from medseg.bench.sites_figures import training_curve

    # training started at t = 100 (after 40 s of start-up); each validation took 3 s
    records = [
        {"train_start": 100.0, "time": 113.0, "val_s": 3.0, "val_dice": 0.4},
        {"train_start": 100.0, "time": 126.0, "val_s": 3.0, "val_dice": 0.7},
        {"train_start": 100.0, "time": 130.0, "val_dice": None},  # an epoch without validation
    ]
    assert training_curve(records) == [(10.0, 0.4), (20.0, 0.7), (24.0, None)]


def test_watchdog_bounds_a_long_phase() -> None:
    dog = Watchdog(np_=2, timeout_s=20.0, started=0.0)
    states = {0: _state("validate", 5000.0, since=10.0), 1: _state("wait", 5000.0, since=10.0)}
    assert dog.verdict(states, now=1000.0) is None
    assert "phase 'validate'" in (dog.verdict(states, now=5000.0) or "")


def test_watchdog_leaves_finished_ranks_alone() -> None:
    dog = Watchdog(np_=2, timeout_s=20.0, started=0.0)
    states = {0: _state("validate", 500.0, since=450.0), 1: _state("done", 400.0, since=400.0)}
    assert dog.verdict(states, now=501.0) is None


def test_watchdog_gives_a_starting_rank_the_start_up_grace() -> None:
    dog = Watchdog(np_=2, timeout_s=20.0, started=0.0)
    states = {0: _state("start", 10.0, since=10.0), 1: _state("load", 99.0, since=50.0)}
    assert dog.verdict(states, now=100.0) is None  # 90 s in Horovod's init: still starting
    assert "rank 0" in (dog.verdict(states, now=10.0 + 181.0) or "")


def test_bench_sites_reuse_takes_an_earlier_result_and_refuses_other_settings(tmp_path) -> None:
    """`bench sites --reuse` completes a seeded run in parts: what the earlier JSON holds is not run again."""
    import json

    from medseg.bench.sites import bench_sites, check_targets, format_table
    from medseg.errors import ConfigError

    earlier = json.loads((Path(__file__).resolve().parents[2] / "docs" / "bench-sites-full.json").read_text())
    for scenario in earlier["scenarios"].values():  # as a run that reused nothing wrote them
        for c in scenario["configs"].values():
            c.pop("reused", None)
            c.pop("reused_probe", None)
    configs = list(earlier["scenarios"]["wan20"]["configs"])
    got = bench_sites(tmp_path, seeds=3, epochs=8, scenarios=["wan20"], configs=configs, reuse=earlier)
    assert not (tmp_path / "data").exists()  # nothing ran: no data was made
    res = got["scenarios"]["wan20"]
    assert all(c["reused"] for c in res["configs"].values())
    for name in configs:
        assert (
            res["configs"][name]["dice_equal_epochs"]
            == earlier["scenarios"]["wan20"]["configs"][name]["dice_equal_epochs"]
        )
    assert res["rtt_ms"] == earlier["scenarios"]["wan20"]["rtt_ms"]
    assert "bsp-none (earlier run)" in format_table(got)
    assert check_targets(got)
    with pytest.raises(ConfigError, match="same settings"):
        bench_sites(tmp_path, seeds=1, epochs=8, scenarios=["wan20"], configs=configs, reuse=earlier)


def test_bench_sites_judges_the_dice_band_on_three_seeds_only() -> None:
    """The two-sided band against bsp-none is a check on the seeded run's mean; one seed only shows it."""
    import copy
    import json

    from medseg.bench.sites import check_targets

    full = json.loads((Path(__file__).resolve().parents[2] / "docs" / "bench-sites-full.json").read_text())
    band = lambda res: {n: ok for n, ok in check_targets(res) if "Dice at equal epochs within" in n}  # noqa: E731
    assert band(full)
    worse = copy.deepcopy(full)
    c = worse["scenarios"]["wan20"]["configs"]
    c["gssp"]["dice_equal_epochs"] = c["bsp-none"]["dice_equal_epochs"] - 0.05
    assert [ok for n, ok in band(worse).items() if n.startswith("wan20: gssp ")] == [False]
    worse["seeds"] = 1
    assert band(worse) == {}


def test_each_rank_keeps_its_sync_state_of_the_two_previous_epochs(tmp_path: Path) -> None:
    """With sites a rank can end epoch e + 1 while the chief writes epoch e's checkpoint; a chief that
    dies then resumes from epoch e - 1's marker, whose files must still be there."""
    from medseg.distributed import sync_checkpoint

    for epoch in range(1, 5):
        sync_checkpoint.save({"x": torch.tensor([float(epoch)])}, tmp_path, epoch, 1, "b-0")
    kept = sorted(p.name for p in (tmp_path / "checkpoints" / "sync").glob("*.pt"))
    assert kept == ["b-0-e2.pt", "b-0-e3.pt", "b-0-e4.pt"]
    state = sync_checkpoint.load(tmp_path, "b-0", {"epoch": 2, "ranks": 4}, 1, 4, by_site=True)
    assert state is not None and float(state["x"][0]) == 2.0
