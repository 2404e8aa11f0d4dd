"""``medseg bench memory``'s target checks: each one fails when its condition does not hold.

The inputs are hand-made result documents with the schema ``bench_memory`` writes (peaks in bytes,
step times in seconds); only the verdicts of ``check_targets`` are under test here.
"""

from __future__ import annotations

import pytest

from medseg.bench.memory import TARGET_PEAK, TARGET_PEAK_MANY, TARGET_TIME, check_targets


def _result(case: str, classes: int, fused: tuple[float, float], checkpoint: tuple[float, float]) -> dict:
    """Baseline peak 100 B at 1 s; fused and checkpoint given as (peak ratio, time ratio)."""

    def row(peak: float, step: float) -> dict:
        return {"peak_bytes": 100 * peak, "saved_bytes": 50 * peak, "step_s": step}

    return {
        "cases": {case: {"net": "unet", "classes": classes, "width": 1.0}},
        "nets": {case: {"baseline": row(1, 1), "fused": row(*fused), "checkpoint": row(*checkpoint)}},
    }


def _verdicts(result: dict) -> dict[str, bool]:
    """Check label prefix (up to the first number) -> passed."""
    out = {}
    for line, ok in check_targets(result):
        if "peak" in line and "baseline" in line:
            out["peak"] = ok
        elif "step time" in line:
            out["time"] = ok
        elif "checkpoint" in line:
            out["checkpoint"] = ok
            out["checkpoint_line"] = line
    return out


def test_all_met_when_fused_is_lower_and_faster():
    v = _verdicts(_result("unet", 3, fused=(0.5, 0.9), checkpoint=(0.7, 1.3)))
    assert v["peak"] and v["time"] and v["checkpoint"]
    assert "fused faster at a peak no higher" in v["checkpoint_line"]


@pytest.mark.parametrize("classes,target", [(3, TARGET_PEAK), (14, TARGET_PEAK_MANY)])
def test_peak_target_fails_just_above_it(classes, target):
    assert _verdicts(_result("c", classes, fused=(target, 1.0), checkpoint=(1, 2)))["peak"]
    assert not _verdicts(_result("c", classes, fused=(target + 0.01, 1.0), checkpoint=(1, 2)))["peak"]


def test_many_class_case_is_held_to_its_own_target():
    between = (TARGET_PEAK_MANY + TARGET_PEAK) / 2
    assert _verdicts(_result("unet", 3, fused=(between, 1.0), checkpoint=(1, 2)))["peak"]
    assert not _verdicts(_result("unet-14cls", 14, fused=(between, 1.0), checkpoint=(1, 2)))["peak"]


def test_time_target_fails_just_above_it():
    assert _verdicts(_result("c", 3, fused=(0.5, TARGET_TIME), checkpoint=(1, 2)))["time"]
    assert not _verdicts(_result("c", 3, fused=(0.5, TARGET_TIME + 0.01), checkpoint=(1, 2)))["time"]


@pytest.mark.parametrize(
    "fused,checkpoint,loses",
    [
        ((0.63, 1.16), (0.55, 1.20), "peak"),  # faster but higher: a check on time alone would pass this
        ((0.50, 1.30), (0.70, 1.20), "time"),
        ((0.70, 1.30), (0.60, 1.20), "time and peak"),
    ],
)
def test_checkpoint_comparison_needs_both_time_and_peak(fused, checkpoint, loses):
    v = _verdicts(_result("c", 3, fused=fused, checkpoint=checkpoint))
    assert not v["checkpoint"]
    assert v["checkpoint_line"].endswith(f"fused loses on {loses}")
