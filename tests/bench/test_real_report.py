"""The real-MR benchmark's report (scripts/real_report.py): the plan's step-time target check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from real_report import plan_time_check  # noqa: E402


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
