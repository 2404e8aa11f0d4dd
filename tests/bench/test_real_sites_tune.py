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
        "grid": {n: grid_points(n) for n in scores}, "started": 1796400000.0,
    }  # fmt: skip


def test_a_later_run_adds_its_configs_to_an_earlier_one_of_the_same_rule() -> None:
    earlier = _tune_result()
    later = _tune_result()
    later["scores"] = {"diloco": [{"point": {"lr": 0.003, "inner_steps": 500}, "dice": 0.7, "job_s": 90.0}]}
    later.update(
        winners={"diloco": {"lr": 0.003, "inner_steps": 500}}, grid={"diloco": grid_points("diloco")}
    )
    later.update(setting={"k": 9.1}, started=earlier["started"] + 86400)
    merged = real_sites_tune.add_to(earlier, later)
    assert merged["winners"] == {"bsp-hier": {"lr": 0.003}, "diloco": {"lr": 0.003, "inner_steps": 500}}
    assert merged["scores"]["bsp-hier"] is earlier["scores"]["bsp-hier"]
    assert [r["configs"] for r in merged["invocations"]] == [["bsp-hier"], ["diloco"]]
    intro = real_sites_tune.intro(merged)
    assert (
        "bsp-hier: tuned 2026-12-04 at k = 10.3" in intro and "diloco: tuned 2026-12-05 at k = 9.1" in intro
    )
    # a config tuned again replaces its earlier grid, and the runs stay listed
    retuned = {"bsp-hier": [{"point": {"lr": 0.001}, "dice": 0.9, "job_s": 50.0}]}
    again = real_sites_tune.add_to(
        merged, {**earlier, "scores": retuned, "winners": {"bsp-hier": {"lr": 0.001}}}
    )
    assert again["scores"]["bsp-hier"] is retuned["bsp-hier"] and len(again["invocations"]) == 3
    assert again["winners"] == {"bsp-hier": {"lr": 0.001}, "diloco": {"lr": 0.003, "inner_steps": 500}}
    with pytest.raises(ConfigError, match="epochs, seed, tie"):
        real_sites_tune.add_to({**earlier, "epochs": 3}, later)
    with pytest.raises(ConfigError, match="no grid"):
        real_sites_tune.check_same_rule({k: v for k, v in earlier.items() if k != "winners"}, 4)


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


def test_an_earlier_file_of_another_rule_is_refused_before_anything_runs(tmp_path: Path) -> None:
    earlier = tmp_path / "t.json"
    earlier.write_text(json.dumps({**_tune_result(), "epochs": 3}))
    args = ["bench", "real-sites-tune", "--data", str(tmp_path / "none"), "--json", str(tmp_path / "o.json")]
    proc = subprocess.run(
        [sys.executable, "-m", "medseg", *args, "--add-to", str(earlier)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--add-to: the earlier file's rule [3, 100" in proc.stderr
    assert not (tmp_path / "o.json").exists()
