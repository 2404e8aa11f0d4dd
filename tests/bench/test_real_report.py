"""The real-MR benchmark's report (scripts/real_report.py): the plan's step-time target check and
the bands over seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from real_report import plan_time_check, rows, seed_bands  # noqa: E402


def _run(plan_step_s: float, train_step_s: float, epochs: int | None = None) -> dict:
    return {
        "system": "medseg",
        "variant": "planned",
        "seed": 0,
        "epochs": epochs,
        "plan_step_s": plan_step_s,
        "train_step_s": train_step_s,
    }


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [(0.252, "PASS"), (0.095, "FAIL"), (0.41, "FAIL")],  # 0.83x; the old probe's 0.32x; 1.35x
)
def test_the_plan_time_check_holds_the_measured_step_within_30_percent(measured: float, verdict: str) -> None:
    (line,) = plan_time_check([_run(0.303, 0.252), _run(0.303, measured)])
    assert line.endswith(verdict), line


def test_runs_with_their_own_epochs_are_not_the_plans() -> None:
    assert plan_time_check([_run(0.303, 0.095, epochs=31)]) == []


def _result(seed: int, dice: tuple[float, float], commit: str = "abc1234", plan_step_s: float = 1.1) -> dict:
    a, p = dice
    return {
        "system": "medseg", "variant": "planned", "budget_cpu_min": 60.0, "seed": seed, "epochs": None,
        "plan_step_s": plan_step_s, "train_step_s": 1.0,
        "train_cpu_s": 3000.0 + seed, "commit": commit, "load": 0.0,
        "eval": {"as-trained": {"dice_Anterior": a, "dice_Posterior": p, "dice": (a + p) / 2, "cpu_s": 9.0}},
    }  # fmt: skip


def test_seed_bands_give_the_mean_and_both_ends_over_the_seeds_of_one_configuration() -> None:
    results = [
        _result(0, (0.88, 0.86)),
        _result(1, (0.90, 0.87), commit="def5678"),  # the same plan, on a later commit
        _result(2, (0.86, 0.85)),
        _result(3, (0.70, 0.70), plan_step_s=0.3),  # another plan, one seed: no band
    ]
    (header, _, line) = seed_bands(rows(results))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:7] == ["medseg", "planned", "60", "plan's", "as-trained", "abc1234, def5678", "0, 1, 2"], (
        cells
    )
    assert cells[8:] == ["0.880 [0.860, 0.900]", "0.860 [0.850, 0.870]", "0.870 [0.855, 0.885]"], cells
    assert seed_bands(rows(results[3:])) == []


def test_the_held_out_band_is_two_sided_and_as_wide_as_the_mean_s_standard_error() -> None:
    """Against the normal-theory interval: for 40 cases the bootstrap band of the mean is about
    mean +- 1.96 s / sqrt(40) wide (s: the cases' standard deviation)."""
    import numpy as np
    from real_report import held_out_band

    values = np.random.default_rng(3).normal(0.88, 0.04, size=40)
    lo, hi = held_out_band(values.tolist())
    half = 1.96 * values.std(ddof=1) / np.sqrt(len(values))
    assert lo < values.mean() < hi
    assert abs((hi - lo) / 2 - half) < 0.15 * half, ((hi - lo) / 2, half)
    assert abs((lo + hi) / 2 - values.mean()) < 0.25 * half


def test_runs_that_kept_their_cases_get_a_band_and_the_target_line_names_it() -> None:
    from real_report import case_bands, checks

    result = _result(0, (0.88, 0.87))
    result["eval"]["as-trained"]["per_case"] = {
        "dice_Anterior": [0.86, 0.88, 0.90] * 10, "dice_Posterior": [0.85, 0.87, 0.89] * 10
    }  # fmt: skip
    result["train_cpu_s"] = 3000.0
    (_, _, line) = case_bands(rows([result, _result(1, (0.8, 0.8))]))
    assert line.startswith("| medseg | planned | as-trained | 0 | 50.0 | 0.880 [0.8"), line
    (target,) = checks(rows([result]))
    assert "95% held-out bands [0.87" in target and target.endswith("FAIL"), target
