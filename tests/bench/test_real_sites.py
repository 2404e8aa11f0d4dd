"""``medseg bench real-sites``: its setting (site folders, probe folders, dilated links) and its
derived figures and targets (regime, bsp-hier's estimate on the WAN, best peer, two-sided band),
on hand-made results whose answers are worked out here by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medseg.bench import real_sites
from medseg.bench.real_sites_report import best, bsp_hier_on_wan, check_targets, format_table, regime
from medseg.distributed.testbed.probe import probe_rtt_share


def _rank_time(compute: float, wan: float, wall: float, ranks: int = 4) -> list[dict]:
    return [{"compute_s": compute, "site_s": 0.0, "wan_wait_s": wan, "wall_s": wall} for _ in range(ranks)]


def _run(t_launch: float | None, held: float, steps: int = 80, epochs: int = 8, wall: float = 80.0) -> dict:
    # Dice reaches 0.85 at the 4th of 8 epochs
    dice = [0.5, 0.6, 0.7, 0.86, 0.87, 0.87, 0.88, 0.88][:epochs]
    curve = [(10.0 * (i + 1), d) for i, d in enumerate(dice)]
    return {
        "time_to_dice_job_s": t_launch,
        "time_to_dice_s": None if t_launch is None else t_launch - 20,
        "dice_equal_epochs": 0.86,
        "held_out": {"a": held, "b": held, "c": held, "mean": held},
        "curve": curve,
        "steps": steps,
        "epochs": epochs,
        "rank_time": _rank_time(40.0, 0.0, wall),
        "wan_payload_measured": 1e6,
        "samples_per_s": 2.0,
        "job_s": 100.0,
    }


def _config(t_launch: float | None, held: float, seeds: int = 1, payload: float = 1e6) -> dict:
    runs = [_run(t_launch, held) for _ in range(seeds)]
    for r in runs:
        r["wan_payload_measured"] = payload
    return {**runs[0], "runs": runs, "seeds": seeds, "held_out_mean": held, "wan_payload_measured": payload}


def _result(
    gssp_s: float | None = 100.0, gssp_dice: float = 0.86, seeds: int = 1, probe_wan: float = 30.0
) -> dict:
    # probe: 6 steps, 0.5 s compute per step on the slowest rank, 30 s WAN wait per step, 31 s wall
    probe = {
        "steps": 6,
        "rank_time": _rank_time(3.0, 6 * probe_wan, 6 * (probe_wan + 1)),
        "wan_payload_measured": 6e6,
    }
    # rank 0 computes half as long and waits the difference: the slowest rank's compute counts
    probe["rank_time"][0] = {**probe["rank_time"][0], "compute_s": 1.5, "wall_s": 6 * (probe_wan + 1)}
    return {
        "seeds": seeds,
        "setting": {"dice_target": 0.85},
        "lan": {"bsp-hier": _config(120.0, 0.86, seeds)},
        "bsp_hier_probe": probe,
        "wan": {
            "fedavg": _config(400.0, 0.855, seeds, payload=20e6),
            "diloco": _config(None, 0.84, seeds, payload=20e6),
            "gssp-topk1": _config(gssp_s, gssp_dice, seeds, payload=0.5e6),
        },
    }


def test_regime_is_time_not_computing_over_the_slowest_compute_per_step() -> None:
    r = regime(_result())
    # 31 s wall less 0.5 s compute on three ranks, less 0.25 s on rank 0
    assert r["wan_per_step_s"] == pytest.approx((30.75 + 3 * 30.5) / 4)
    assert r["compute_per_step_s"] == pytest.approx(0.5)
    assert r["ratio"] == pytest.approx(61.125)


def test_bsp_hier_on_the_wan_adds_the_probes_extra_seconds_per_step() -> None:
    # control: 80 steps in 8 epochs, wall 80 s (1 s/step), Dice reached after epoch 4 (40 steps)
    # probe: 31 s/step, so 30 s extra per step: 120 + 40 x 30 = 1320 s; payload 1 MB/step x 40
    est = bsp_hier_on_wan(_result())
    assert est["time_to_dice_job_s"] == pytest.approx(1320.0)
    assert est["wan_payload"] == pytest.approx(40e6)


def test_best_peer_and_best_gssp_by_time_from_launch() -> None:
    b = best(_result())
    assert (b["peer"], b["peer_s"]) == ("fedavg", 400.0)  # diloco never reached it; bsp-hier est. 1320
    assert (b["gssp"], b["gssp_s"]) == ("gssp-topk1", 100.0)


@pytest.mark.parametrize(("gssp_s", "met"), [(200.0, True), (201.0, False), (None, False)])
def test_time_target_is_half_the_best_peer(gssp_s: float | None, met: bool) -> None:
    checks = {t.name.split(" (got")[0]: t.met for t in check_targets(_result(gssp_s))}
    time_checks = [ok for name, ok in checks.items() if "best peer" in name]
    assert time_checks == [met]


def test_bytes_and_no_wan_targets() -> None:
    targets = check_targets(_result(gssp_s=140.0))
    by = {t.name.split(":")[1].split("(got")[0].strip(): t.met for t in targets}
    # gssp 0.5 MB against bsp-hier's estimated 40 MB: 1/80 <= 1/50
    assert by["best gssp WAN bytes <= 1/50 of bsp-hier's"] is True
    # 140 s on the WAN against 120 s on the control: 1.17x <= 1.2x; 150 s would not be
    assert by["best gssp on the dilated WAN <= 1.2x bsp-hier on the no-WAN control"] is True
    assert not [t for t in check_targets(_result(gssp_s=150.0)) if "no-WAN" in t.name][0].met


@pytest.mark.parametrize(("dice", "met"), [(0.869, True), (0.851, True), (0.845, False), (0.875, False)])
def test_dice_band_is_two_sided_and_judged_only_with_three_seeds(dice: float, met: bool) -> None:
    assert not [t for t in check_targets(_result(gssp_dice=dice, seeds=1)) if "held-out" in t.name]
    band = [t for t in check_targets(_result(gssp_dice=dice, seeds=3)) if "gssp-topk1 held-out" in t.name]
    assert [t.met for t in band] == [met]


def test_table_names_every_config_and_the_estimate() -> None:
    text = format_table(_result())
    for name in ("bsp-hier", "fedavg", "diloco", "gssp-topk1", "bsp-hier (estimated)"):
        assert f"| {name} |" in text
    assert "61.12x" in text  # the regime line


def test_sites_links_and_probe_folders(tmp_path: Path) -> None:
    net = real_sites.network(8.0)
    c = net.link("c")
    assert c.rate_bit == 10_000_000 // 8 and c.delay_ms == pytest.approx(320.0)
    train = tmp_path / "a"
    train.mkdir()
    doc = {
        "name": "x",
        "labels": {"0": "bg"},
        "training": [{"image": f"i{i}", "label": f"l{i}"} for i in range(9)],
    }
    (train / "dataset.json").write_text(json.dumps(doc))
    probe = real_sites._probe_folder(train, tmp_path / "a-probe")
    assert [c["image"] for c in json.loads((probe / "dataset.json").read_text())["training"]] == [
        f"i{i}" for i in range(real_sites.PROBE_CASES)
    ]
    pooled = real_sites._pooled_folder(tmp_path / "pooled", [train, train])
    assert json.loads((pooled / "dataset.json").read_text())["numTraining"] == 18


def test_dilation_counts_the_data_work_on_both_sides() -> None:
    # slowest quota 0.3 core: a CPU site's step (0.01 + 0.05) / 0.3 = 0.2 s; a GPU site's 0.01 + 0.01
    assert real_sites.dilation(0.01, 0.05, 0.01) == pytest.approx(10.0)
    # without data work it is the networks' ratio alone: 0.05 / 0.3 / 0.01
    assert real_sites.dilation(0.0, 0.05, 0.01) == pytest.approx(50.0 / 3)


def test_report_names_the_measured_step_costs() -> None:
    from medseg.bench.real_sites_report import intro

    result = _result()
    result["setting"].update(
        counts={}, held_out=10, sites="a:2", cpu_per_rank={"a": 0.45, "c": 0.3}, model="unet", patch=[1, 2, 3],
        lr=0.003, links_nominal={}, links_dilated="x", epochs=8, max_epochs=16,
        cpu_step_s=0.05, data_step_s=0.01, gpu_step_s=0.01, k=10.0,
    )  # fmt: skip
    result.update(seeds=3, load_start=[0.1], load_end=[0.2], wall_s=60.0)
    text = intro(result)
    assert "0.0100 s of data work and 0.0500 s of network" in text and "at 0.3 core" in text
    assert "network's 0.0100 s measured on an H200" in text and "k = 10.0" in text
    result["setting"]["gpu_step_s"] = 0.02
    assert "network's 0.0200 s from --gpu-step-s" in intro(result)


def test_bbr_probe_rtt_share() -> None:
    cc = Path("/proc/sys/net/ipv4/tcp_congestion_control")
    if not cc.exists() or cc.read_text().strip() != "bbr":
        assert probe_rtt_share(1000.0) == 1.0
        return
    assert probe_rtt_share(50.0) == pytest.approx(0.98)  # ProbeRTT's 200 ms floor
    assert probe_rtt_share(1000.0) == pytest.approx(0.90)  # one round trip per 10 s


def test_startup_figures_take_each_phase_from_its_slowest_rank():
    from medseg.bench.sites_figures import startup_figures

    ranks = {
        0: [
            {"ev": "started", "t": 105.0},
            {"ev": "startup", "rank": 0, "t": 190.0, "horovod_init": 20.0, "channel_world": 9.0},
        ],
        1: [
            {"ev": "started", "t": 112.5},
            {"ev": "startup", "rank": 1, "t": 191.0, "horovod_init": 26.0, "channel_world": 4.0},
        ],
        2: [{"epoch": 1, "step": 0, "t": 200.0}],
    }
    fig = startup_figures(ranks, launched=100.0)
    assert fig["ranks_up_s"] == 12.5
    assert fig["startup_phases"] == {"horovod_init": 26.0, "channel_world": 9.0}
    assert startup_figures({0: []}, 100.0) == {"ranks_up_s": None, "startup_phases": None}


def test_the_time_target_names_its_seed_by_seed_band() -> None:
    from medseg.bench.real_sites_report import seed_ratios

    res = _result(gssp_s=200.0, seeds=3)
    # seed 1 of gssp-topk1 slower, seed 2 of fedavg slower: ratios 0.5, 0.75, 0.4 (paired by seed)
    res["wan"]["gssp-topk1"]["runs"][1] = {**res["wan"]["gssp-topk1"]["runs"][1], "time_to_dice_job_s": 300.0}
    res["wan"]["fedavg"]["runs"][2] = {**res["wan"]["fedavg"]["runs"][2], "time_to_dice_job_s": 500.0}
    assert seed_ratios(res, "gssp-topk1", "fedavg") == pytest.approx([0.5, 0.75, 0.4])
    text = next(t.name for t in check_targets(res) if "best gssp (gssp-topk1) time to Dice" in t.name)
    assert "seed by seed 0.40-0.75x" in text
    # a seed that never reached the target leaves no band
    res["wan"]["fedavg"]["runs"][0] = {**res["wan"]["fedavg"]["runs"][0], "time_to_dice_job_s": None}
    assert seed_ratios(res, "gssp-topk1", "fedavg") == []


def test_step_costs_are_measured_and_leave_the_thread_count_alone(tmp_path: Path) -> None:
    import torch

    from medseg.datasets.synthetic import make_seg_dataset

    data = make_seg_dataset(tmp_path / "seg", n_train=3, n_test=0, seed=2, size=48, modality="mr")
    plan = {**json.loads(json.dumps(real_sites.PLAN)), "data": {"dir": str(data), "val_fraction": 0.0}}
    threads = torch.get_num_threads()
    d = real_sites.measure_data_step(plan, steps=4)  # 3 cases: the draw runs over two epochs
    c = real_sites.measure_cpu_step(plan, classes=3, steps=2)
    assert 0 < d < 10 and 0 < c < 10
    assert torch.get_num_threads() == threads
