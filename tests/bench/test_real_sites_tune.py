"""The real-sites tuning rule: its grids, its choice, the winners file, and the jobs it configures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from medseg.bench import real_sites, real_sites_tune
from medseg.bench.real_sites_tune import TIE, choose, grid_points, tuned_points
from medseg.errors import ConfigError


def test_every_grid_starts_at_the_planners_values_and_crosses_the_levers() -> None:
    assert grid_points("gssp-fixed4") == [{"lr": 0.003}, {"lr": 0.001}, {"lr": 0.01}]
    fedavg = grid_points("fedavg")
    assert fedavg[0] == {"lr": 0.003, "local_epochs": 1}
    # written out by hand: every lr with every E, no point twice
    want = [{"lr": lr, "local_epochs": e} for lr in (0.003, 0.001, 0.01) for e in (1, 2)]
    assert sorted(map(json.dumps, fedavg)) == sorted(map(json.dumps, want))
    assert grid_points("diloco")[0] == {"lr": 0.003, "inner_steps": 500}


def test_the_rule_takes_the_best_unless_an_earlier_point_ties_it() -> None:
    a, b, c = {"lr": 0.003}, {"lr": 0.001}, {"lr": 0.01}
    assert choose([(a, 0.80), (b, 0.70), (c, 0.82)]) == c  # 0.02 better: not a tie
    assert choose([(a, 0.80), (b, 0.70), (c, 0.80 + TIE / 2)]) == a  # within the tie: the first
    assert choose([(a, None), (b, 0.70), (c, 0.60)]) == b  # a failed point cannot win
    assert choose([(a, None), (b, None)]) is None


def test_the_winners_file_is_data_checked_key_by_key() -> None:
    good = {"winners": {"fedavg": {"lr": 0.001, "local_epochs": 2}, "gssp": {"lr": 0.01}, "diloco": None}}
    assert tuned_points(good) == {"fedavg": {"lr": 0.001, "local_epochs": 2}, "gssp": {"lr": 0.01}}
    for bad in (
        {},
        {"winners": {"nope": {"lr": 0.1}}},
        {"winners": {"gssp": {"local_epochs": 2}}},  # not gssp's lever
        {"winners": {"gssp": {"lr": -0.1}}},
        {"winners": {"gssp": {"lr": "__import__('os')"}}},
        {"winners": {"gssp": {"lr": True}}},
    ):
        with pytest.raises(ConfigError):
            tuned_points(bad)


def _setting(tmp_path: Path, tuned: dict | None = None) -> real_sites.Setting:
    sites = {s: {"train": f"/d/{s}", "test": f"/t/{s}", "probe": f"/p/{s}"} for s in real_sites.COUNTS}
    plan = json.loads(json.dumps(real_sites.PLAN))
    return real_sites.Setting(tmp_path, sites, plan, 0.05, 0.01, 10.0, 3, tuned or {})


def test_a_tuning_job_trains_its_point_for_fixed_epochs_without_a_target(tmp_path: Path) -> None:
    hosts = {s: f"198.18.0.{i}" for i, s in enumerate(real_sites.COUNTS)}
    dist = {**real_sites.CONFIGS["fedavg"], "lr": 0.01, "local_epochs": 2}
    cfg = real_sites.job_config(_setting(tmp_path), "t", dist, 100, hosts, fixed_epochs=4)
    assert cfg["train"]["lr"] == 0.01 and "lr" not in cfg["dist"] and cfg["dist"]["local_epochs"] == 2
    # the table's schedule (its cosine over MAX_EPOCHS), cut after 4 epochs, no target
    t = cfg["train"]
    assert (t["epochs"], t["until_epoch"], t["stop_at"]) == (real_sites.MAX_EPOCHS, 4, 0.0)
    table = real_sites.job_config(_setting(tmp_path), "t", real_sites.CONFIGS["gssp"], 0, hosts)["train"]
    assert table["lr"] == real_sites.PLAN["train"]["lr"]
    assert (table["epochs"], table["until_epoch"], table["stop_at"]) == (
        real_sites.MAX_EPOCHS,
        0,
        real_sites.DICE_TARGET,
    )


def _tune_result() -> dict:
    scores = {
        "bsp-hier": [
            {"point": {"lr": 0.003}, "dice": 0.80, "job_s": 60.0, "curve": [(10.0, 0.5), (20.0, 0.8)]},
            {"point": {"lr": 0.001}, "dice": 0.70, "job_s": 61.0, "curve": [(10.0, 0.4), (20.0, 0.7)]},
            {"point": {"lr": 0.01}, "dice": None, "error": "exit 2"},
        ]
    }
    return {
        "epochs": 4, "seed": 100, "tie": TIE, "scores": scores,
        "winners": {n: choose([(r["point"], r["dice"]) for r in rs]) for n, rs in scores.items()},
        "setting": {"k": 10.3}, "load_start": [0.1], "load_end": [0.2], "wall_s": 600.0,
    }  # fmt: skip


def test_the_report_marks_the_winner_and_fails_when_a_point_failed(tmp_path: Path) -> None:
    result = _tune_result()
    table = real_sites_tune.format_table(result)
    assert "| bsp-hier | lr 0.003 | 0.8000 | 60 | yes |" in table and "failed" in table
    [target] = real_sites_tune.check_targets(result)
    assert not target.met and "bsp-hier {'lr': 0.01}" in target.name
    result["scores"]["bsp-hier"][2].update(dice=0.75, job_s=59.0, curve=[(10.0, 0.75)])
    assert real_sites_tune.check_targets(result)[0].met
    md = tmp_path / "b.md"
    real_sites_tune.write_report(result, tmp_path / "t.json", md)
    assert "real-sites-tune" in md.read_text() and (tmp_path / "bench-real-sites-tune.png").is_file()


def test_the_table_names_its_tuned_points() -> None:
    from medseg.bench.real_sites_report import _tuned_text

    assert "not tuned" in _tuned_text({})
    assert "fedavg lr 0.001, local_epochs 2" in _tuned_text(
        {"tuned": {"fedavg": {"lr": 0.001, "local_epochs": 2}}}
    )


def test_a_bad_tuned_file_is_refused_before_anything_runs(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"winners": {"gssp": {"lr": 0.01, "staleness": 9}}}))
    data = tmp_path / "none"  # never reached: the file is checked first
    args = [
        "bench",
        "real-sites",
        "--data",
        str(data),
        "--json",
        str(tmp_path / "o.json"),
        "--tuned",
        str(bad),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "medseg", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "--tuned: winner of 'gssp'" in proc.stderr
    assert not (tmp_path / "o.json").exists()
