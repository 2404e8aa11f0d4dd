"""``medseg bench sites``: synchronisation modes between emulated hospitals, every figure measured.

Setting (:mod:`medseg.distributed.testbed.testbed`): 2 sites x 2 ranks, each site a network namespace with its
own sshd, ranks launched by horovodrun over real ssh; site b gets half the CPU of site a per rank
(cgroup quotas 0.5 and 0.25 core per rank, 1.5 of the machine's 2 cores in all, one torch thread per
rank); the link between the sites shaped in both directions. Scenarios: no WAN shaping (the
control), 100 Mbit/s with 10 ms one-way, 20 Mbit/s with 25 ms one-way. Before each scenario the
testbed's probe measures RTT and throughput between the sites; more than 10 % off is an error.

Configs: ``bsp-none`` (plain Horovod), ``bsp-fp16``, ``bsp-fixed4``, ``local-sgd``, ``gssp`` (groups
= sites, by host), ``gssp-fixed4``. Every config trains the same UNet on the same synthetic data
for the same epochs with the same seed; validation (rank 0, its own held-out cases) after every
epoch, with its wall-clock time.

Figures, per scenario and config, all measured:

- ``time_to_dice_s``: training wall time (:func:`training_curve`: from rank 0's start of training,
  speed and WAN profiling included, validations excluded) to the first validation at or above the
  Dice target; None when never reached. ``time_to_dice_job_s``: the same from the launch (start-up
  and validations included); ``startup_s``: launch to start of training.
- ``dice_equal_epochs``: validation Dice after the last epoch (same epochs for every config).
- ``dice_at_budget``: the last validation Dice at or before the budget (the fastest config's
  whole training wall time in that scenario).
- ``samples_per_s``: training samples of all ranks over the whole job's wall time.
- ``wan_bytes_measured``: IP bytes the relay's TUN devices carried between the sites during the
  job (:meth:`Testbed.wan_counters`), and ``wan_payload_measured``: the same minus 52 bytes of
  IPv4+TCP headers (with timestamps) per packet, i.e. TCP payload; ``wan_bytes_reported``: the
  cross-host bytes the algorithm believes it sent (its byte model, summed over ranks and epochs).
  They should agree within 5 %; the report says why when they do not.
- ``max_lead_rounds``: from the group leaders' timestamped records: at every moment a group starts
  a round, how many more rounds it has completed than the slowest group (submission times), the
  maximum over the job; compared with ``staleness_bound`` s. Not a value read from the schedule.
- ``insite_step_s_idle`` / ``insite_step_s_with_round_in_flight`` (gssp): median in-site step time
  (forward, backward, in-site averaging) of the leaders' steps with no cross-site round in flight
  and with one in flight.
- a time breakdown per rank: compute, waiting inside the site, waiting on other sites.

Absolute times are not GPU times: the model and patch are sized so that the ratio of (bsp bytes per
step / WAN rate) to step time is that of a real 3D U-Net between hospitals (stated in the output).
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from medseg.bench.report import publish
from medseg.config import config_from_dict
from medseg.datasets.synthetic import make_seg_dataset
from medseg.errors import ConfigError
from medseg.training.runlog import read_metrics

log = logging.getLogger(__name__)

SITES, CPU = "a:2,b:2", "a=0.5,b=0.25"
SCENARIOS = {"lan": "none", "wan100": "100mbit:10ms", "wan20": "20mbit:25ms"}
CONFIGS: dict[str, dict[str, Any]] = {
    "bsp-none": {"sync": "bsp"},
    "bsp-fp16": {"sync": "bsp", "compression": "fp16"},
    "bsp-fixed4": {"sync": "bsp", "compression": "fixed", "bits": 4},
    "local-sgd": {"sync": "local-sgd", "period": 4},
    "gssp": {"sync": "gssp", "staleness": 2},
    "gssp-fixed4": {"sync": "gssp", "staleness": 2, "compression": "fixed", "bits": 4},
}
QUICK_SCENARIOS = ("wan20", "lan")
QUICK_CONFIGS = ("bsp-none", "bsp-fixed4", "gssp", "gssp-fixed4")
DICE_TARGET = 0.8  # held-out Dice every config must reach (full run)
# The quick run (at most 12 minutes, issue 9): 4 epochs; bsp-none reaches 0.68 in them (one seed).
# A config that has not reached 0.65 after 4 epochs goes on (gssp needed a 5th in the eighth
# session's run). The seeded run carries the 0.8 level.
QUICK_DICE_TARGET = 0.65
EPOCHS, QUICK_EPOCHS = 8, 4
MIN_SEEDS_FOR_DICE_BAND = 3  # the "within 0.02 of bsp-none" check needs the mean of this many seeds
MAX_EPOCHS_FACTOR = 2  # a config that has not reached the target after the equal epochs may go on this far
MODEL = {"name": "unet", "channels": [16, 32, 64], "strides": [2, 2], "num_res_units": 1}
LR = 0.01
TRAIN_CASES = 160  # 128 for training (32 steps per bsp epoch at 4 ranks x batch 1), 32 held out
HEADER_BYTES = 52  # IPv4 20 + TCP 20 + timestamps option 12
# The real setting this stands for: MONAI's 3D UNet (16-256 channels, 4.8 M parameters, 19 MB fp32)
# at about 0.5 s per step on a GPU; a 4-rank ring over 2 sites carries 1.5 x 19 MB per direction.
REAL_PARAMS_MB, REAL_STEP_S = 19.3, 0.5


def _config(
    name: str, dist: dict[str, Any], data_dir: Path, runs_dir: Path, epochs: int, seed: int, target: float
) -> dict:
    """One config of the benchmark: the same task, model and optimiser for every synchronisation mode.

    Every config trains at least ``epochs`` (the equal-epochs comparison) and stops once it has also
    reached the Dice ``target``, or after ``MAX_EPOCHS_FACTOR`` x ``epochs``.
    """
    return {
        "name": name,
        "task": "segmentation",
        "runs_dir": str(runs_dir),
        # one disk cache of the deterministic transforms for every job (filled by :func:`fill_cache`
        # before the first launch): launch start-up is not what the benchmark compares
        "data": {
            "dir": str(data_dir),
            "val_fraction": 0.2,
            "cache": "disk",
            "cache_dir": str(data_dir.parent / "cache"),
        },
        "transforms": {
            "spacing": [1.6, 1.6, 2.4],
            "window": [-150, 250],
            "patch": [16, 16, 16],
            "num_samples": 2,
        },
        "model": dict(MODEL),
        "train": {
            "epochs": MAX_EPOCHS_FACTOR * epochs,
            "min_epochs": epochs,
            "stop_at": target,
            "batch_size": 1,
            "lr": LR,
            "seed": seed,
            "threads": 1,
            "scheduler": "none",
        },
        "dist": {"timeout_s": 180, "profile_steps": 5, **dist},
    }


def fill_cache(data_dir: Path, seeds: int) -> float:
    """Fill the jobs' shared disk cache (every seed's training and validation split) in this
    process, at full speed, before the first launch; returns the seconds it took.

    Without it every rank of every job loads and resamples its own cases at its site's CPU quota.
    Most of a job's start-up is elsewhere (site b's ranks import torch and MONAI at 0.25 core and
    start about 14 s after site a's), so this saves seconds, not the start-up.
    """
    from medseg.training.data import fill_disk_cache

    t = time.perf_counter()
    for seed in range(seeds):
        fill_disk_cache(
            config_from_dict(_config("cache", {"sync": "bsp"}, data_dir, data_dir.parent, 1, seed, 0.0))
        )
    return time.perf_counter() - t


def training_curve(records: list[dict]) -> list[tuple[float, float | None]]:
    """(training wall time, validation Dice) after each epoch.

    Training wall time runs from ``train_start`` (rank 0, before the speed and WAN profiling,
    which it therefore includes) to the epoch's record, less the validations before and at that
    epoch: validating every epoch is the benchmark's instrument, not part of training, and it
    would add the same seconds to every config. Launch, imports, ssh and data caching (before
    ``train_start``, the same for every config) are reported apart as ``startup_s``.
    """
    out, val = [], 0.0
    for r in records:
        val += r.get("val_s", 0.0)
        out.append((r["time"] - r["train_start"] - val, r.get("val_dice")))
    return out


def _rank_records(run_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for path in sorted((run_dir / "ranks").glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        out[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def max_lead_rounds(records: dict[int, list[dict]]) -> int | None:
    """The largest lead, in completed rounds, of a group over the slowest when it starts a round.

    Uses the leaders' ``submit`` (round completed, stamped before the exchange is issued) and
    ``start`` (the group passed its staleness wait and goes on) records. None without rounds.
    """
    submits = {r: sorted(e["t"] for e in recs if e.get("ev") == "submit") for r, recs in records.items()}
    submits = {r: ts for r, ts in submits.items() if ts}
    if len(submits) < 2:
        return None
    lead = 0
    for r, recs in records.items():
        for e in recs:
            if e.get("ev") != "start" or r not in submits:
                continue
            done = {h: sum(1 for t in ts if t <= e["t"]) for h, ts in submits.items()}
            lead = max(lead, done[r] - min(done.values()))
    return lead


def insite_step_times(records: dict[int, list[dict]]) -> tuple[float | None, float | None, int, int]:
    """Median in-site step time (compute + in-site averaging) without and with a round in flight.

    Only the group leaders know whether a round is in flight, so only their steps count.
    """
    idle, busy = [], []
    for recs in records.values():
        if not any(e.get("ev") == "submit" for e in recs):
            continue
        for e in recs:
            if "step" in e and "compute_s" in e:
                (busy if e.get("inflight") else idle).append(e["compute_s"] + e["site_s"])
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return med(idle), med(busy), len(idle), len(busy)


def _run_one(
    tb: Any, name: str, dist: dict, data_dir: Path, runs_dir: Path, epochs: int, seed: int, target: float
) -> dict[str, Any]:
    import os

    from medseg.distributed.launch.launcher import launch

    cfg = config_from_dict(_config(name, dist, data_dir, runs_dir, epochs, seed, target))
    path = runs_dir / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    saved = dict(os.environ)
    os.environ.update(tb.launcher_env())
    before = tb.wan_counters()
    t0 = time.time()
    try:
        launch(cfg, path, [], 4, tb.hosts_arg(), False, None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    job_s = time.time() - t0
    after = tb.wan_counters()
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    ranks = _rank_records(cfg.run_dir)
    samples = sum(r["dist_samples_per_s"] * r["dist_epoch_s"] for r in records)
    curve = training_curve(records)
    reached = [t for t, d in curve if d is not None and d >= target]
    reached_job = [r["time"] - t0 for r in records if (r.get("val_dice") or 0) >= target]
    wan_bytes = after["bytes"] - before["bytes"]
    wan_packets = after["packets"] - before["packets"]
    tcp = {k: v - before.get("tcp", {}).get(k, 0) for k, v in after.get("tcp", {}).items()}
    # TCP payload: exact from the relay's look inside the packets, else 52 header bytes per packet
    payload = tcp["payload"] if tcp else wan_bytes - HEADER_BYTES * wan_packets
    idle, busy, n_idle, n_busy = insite_step_times(ranks)
    breakdown = [
        {
            k: round(sum(r["dist_rank_time"][i][k] for r in records), 2)
            for k in ("compute_s", "site_s", "wan_wait_s", "wall_s")
        }
        for i in range(4)
    ]
    return {
        "time_to_dice_s": reached[0] if reached else None,
        "time_to_dice_job_s": reached_job[0] if reached_job else None,
        "startup_s": records[0]["train_start"] - t0,
        "val_s": sum(r.get("val_s", 0.0) for r in records),
        "dice_equal_epochs": next(r.get("val_dice") for r in records if r["epoch"] == epochs),
        "samples_per_s": samples / job_s,
        "job_s": job_s,
        "wan_bytes_measured": wan_bytes,
        "wan_payload_measured": payload,
        "wan_packets": wan_packets,
        "wan_payload_per_epoch": payload / len(records),
        # of the payload, bytes TCP sent again (a burst dropped by the tbf queue); None without a relay
        "wan_retrans_measured": tcp.get("retrans_payload") if tcp else None,
        "wan_tcp": tcp or None,
        # the algorithm's own byte model (set-up transfers included)
        "wan_bytes_reported": sum(r.get("dist_wan_bytes", 0) for r in records),
        "max_lead_rounds": max_lead_rounds(ranks),
        "staleness_bound": dist.get("staleness", 2) if dist["sync"] == "gssp" else 0,
        "insite_step_s_idle": idle,
        "insite_step_s_with_round_in_flight": busy,
        "insite_steps_counted": [n_idle, n_busy],
        "rank_time": breakdown,
        "groups": records[-1].get("dist_groups"),
        "periods": records[-1].get("dist_periods"),
        "epochs": len(records),
        "steps": sum(1 for e in ranks.get(0, []) if "step" in e),
        "curve": curve,
    }


def bench_sites(
    workdir: Path,
    quick: bool = False,
    seeds: int | None = None,
    epochs: int | None = None,
    scenarios: list[str] | None = None,
    configs: list[str] | None = None,
    reuse: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every scenario and config (``quick``: 2 scenarios x 4 configs, 1 seed), or those named.

    ``reuse``: an earlier result of this function with the same seeds, epochs and ``quick``; each
    (scenario, config) it holds is taken from it (marked ``"reused": True``, its own probe kept
    beside it) instead of being run again, so a long seeded run can be completed in parts.
    """
    from medseg.distributed.testbed.testbed import testbed

    workdir.mkdir(parents=True, exist_ok=True)
    seeds = seeds or (1 if quick else 3)
    epochs = epochs or (QUICK_EPOCHS if quick else EPOCHS)
    target = QUICK_DICE_TARGET if quick else DICE_TARGET
    scenarios = scenarios or (QUICK_SCENARIOS if quick else tuple(SCENARIOS))
    configs = configs or (QUICK_CONFIGS if quick else tuple(CONFIGS))
    unknown = [s for s in scenarios if s not in SCENARIOS] + [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ConfigError(
            f"bench sites: unknown scenario or config {unknown}; scenarios {list(SCENARIOS)}, configs {list(CONFIGS)}"
        )
    if "bsp-none" not in configs:
        raise ConfigError("bench sites: every ratio is against bsp-none; keep it in --configs")
    out: dict[str, Any] = {
        "quick": quick,
        "seeds": seeds,
        "epochs": epochs,
        "dice_target": target,
        "scenarios": {},
    }
    earlier = _reusable(reuse, quick, seeds, epochs)
    if any(c not in earlier.get(sc, {}).get("configs", {}) for sc in scenarios for c in configs):
        data_dir = make_seg_dataset(workdir / "data", n_train=TRAIN_CASES, n_test=0, seed=7, size=48)
        out["cache_fill_s"] = fill_cache(data_dir, seeds)
        log.info("bench sites: data cache filled in %.0f s", out["cache_fill_s"])
    for scenario in scenarios:
        wan = SCENARIOS[scenario]
        old = earlier.get(scenario, {})
        kept = {c: dict(old["configs"][c], reused=True) for c in configs if c in old.get("configs", {})}
        if len(kept) == len(configs):
            res = {k: v for k, v in old.items() if k != "configs"}
            res["configs"] = {c: kept[c] for c in configs}
            _budget(res)
            out["scenarios"][scenario] = res
            log.info("bench sites: %s taken whole from the earlier result", scenario)
            continue
        with testbed(sites=SITES, wan=wan, cpu=CPU) as tb:
            probe = tb.probe(check=wan != "none")
            res: dict[str, Any] = {
                "wan": wan,
                "rtt_ms": probe.get("rtt_ms"),
                "mbit_s": probe.get("mbit_s"),
                "probe": probe,
                "configs": {},
            }
            for name in configs:
                if name in kept:
                    log.info("bench sites: %s %s taken from the earlier result", scenario, name)
                    res["configs"][name] = {**kept[name], "reused_probe": old.get("probe")}
                    continue
                runs = []
                for seed in range(seeds):
                    log.info("bench sites: %s %s seed %d", scenario, name, seed)
                    runs.append(
                        _run_one(
                            tb,
                            name,
                            CONFIGS[name],
                            data_dir,
                            workdir / "runs" / scenario / f"seed{seed}",
                            epochs,
                            seed,
                            target,
                        )
                    )
                res["configs"][name] = _aggregate(runs)
        _budget(res)
        out["scenarios"][scenario] = res
    out["setting"] = _setting(out)
    return out


def _reusable(reuse: dict[str, Any] | None, quick: bool, seeds: int, epochs: int) -> dict[str, Any]:
    """The scenarios of an earlier result that this run may take configs from (same settings), else {}."""
    if not reuse:
        return {}
    theirs = (reuse.get("quick"), reuse.get("seeds"), reuse.get("epochs"))
    if theirs != (quick, seeds, epochs):
        raise ConfigError(
            f"bench sites --reuse: that result has quick, seeds, epochs = {theirs}, this run {(quick, seeds, epochs)}; "
            "only a result with the same settings can be completed"
        )
    return reuse.get("scenarios", {})


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _aggregate(runs: list[dict]) -> dict[str, Any]:
    """Mean over seeds (spread as min..max) of the numeric figures; the first seed's curve and details."""
    agg = dict(runs[0])
    for key in (
        "time_to_dice_s",
        "time_to_dice_job_s",
        "startup_s",
        "dice_equal_epochs",
        "samples_per_s",
        "job_s",
        "wan_bytes_measured",
        "wan_payload_measured",
        "wan_payload_per_epoch",
        "wan_retrans_measured",
        "wan_bytes_reported",
        "insite_step_s_idle",
        "insite_step_s_with_round_in_flight",
    ):
        vals = [r[key] for r in runs]
        agg[key] = None if any(v is None for v in vals) and key.startswith("time_to_dice") else _mean(vals)
        nums = [v for v in vals if v is not None]
        agg[f"{key}_spread"] = [min(nums), max(nums)] if nums else None
    leads = [r["max_lead_rounds"] for r in runs if r["max_lead_rounds"] is not None]
    agg["max_lead_rounds"] = max(leads) if leads else None
    agg["seeds"] = len(runs)
    agg["runs"] = runs
    return agg


def _budget(res: dict[str, Any]) -> None:
    budget = min(c["curve"][-1][0] for c in res["configs"].values())
    res["budget_s"] = budget
    for c in res["configs"].values():
        seen = [d for t, d in c["curve"] if t <= budget and d is not None]
        c["dice_at_budget"] = seen[-1] if seen else None


def _setting(out: dict[str, Any]) -> dict[str, Any]:
    """The comm/compute ratio this run has, against a real 3D U-Net between hospitals at 20 Mbit/s."""
    s = out["scenarios"].get("wan20")
    if not s or "bsp-none" not in s["configs"]:
        return {}
    c = s["configs"]["bsp-none"]
    steps = max(c["steps"], 1)
    per_step_bytes = c["wan_bytes_reported"] / 2 / steps  # per direction
    rate = 20e6 / 8
    compute = max(rt["compute_s"] for rt in c["rank_time"]) / steps  # the slowest rank sets bsp's pace
    ours = (per_step_bytes / rate) / compute if compute else None
    real = (1.5 * REAL_PARAMS_MB * 1e6 / rate) / REAL_STEP_S
    return {
        "comm_to_compute_ours": ours,
        "comm_to_compute_real_unet": real,
        "note": (
            f"bsp-none at 20 Mbit/s: ours {ours:.1f}x WAN time per step over compute per step; MONAI's 4.8M-parameter "
            f"3D UNet at {REAL_STEP_S} s/step on a GPU would be {real:.0f}x. Times here are CPU times, not GPU times."
            if ours
            else ""
        ),
    }


def ratios(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    base = res["configs"].get("bsp-none", {})
    out = {}
    for name, c in res["configs"].items():
        t, b = c.get("time_to_dice_s"), base.get("time_to_dice_s")
        out[name] = {
            "time_x": (t / b) if t and b else None,
            "speed_x": c["samples_per_s"] / base["samples_per_s"] if base else None,
            "bytes_x": (c["wan_payload_per_epoch"] / base["wan_payload_per_epoch"])
            if base.get("wan_payload_per_epoch")
            else None,
            "dice_delta": (c["dice_equal_epochs"] or 0) - (base.get("dice_equal_epochs") or 0),
            "bytes_agree": (
                abs(c["wan_payload_measured"] - c["wan_bytes_reported"]) / c["wan_bytes_reported"]
            )
            if c["wan_bytes_reported"] and res["wan"] != "none"
            else None,
        }
    return out


def check_targets(result: dict[str, Any]) -> list[tuple[str, bool]]:
    checks: list[tuple[str, bool]] = []
    w = result["scenarios"].get("wan20")
    if w:
        q, c = ratios(w), w["configs"]
        for name, limit in (("gssp", 0.5), ("gssp-fixed4", 1 / 3)):
            if name in q:
                x = q[name]["time_x"]
                checks.append(
                    (
                        f"wan20: {name} time to Dice {result['dice_target']} <= {limit:.2f}x bsp-none (got {_fmt(x)})",
                        x is not None and x <= limit,
                    )
                )
        # the Dice level at which "within 0.02" is judged: the seeded run's 0.8, the quick run's target
        base, level = c["bsp-none"]["dice_equal_epochs"] or 0, result["dice_target"]
        checks.append((f"wan20: bsp-none Dice at equal epochs >= {level} (got {base:.3f})", base >= level))
        # The 0.02 band is judged on the mean of 3 seeds (issue 9): one seed cannot resolve it. The
        # same seed's Dice after 4 epochs differed by 0.06 between two runs of gssp (its rounds follow
        # measured timings); the quick run's table shows the one-seed figures without judging them.
        for name in c if result["seeds"] >= MIN_SEEDS_FOR_DICE_BAND else ():
            if name != "bsp-none":
                d = q[name]["dice_delta"]
                checks.append(
                    (f"wan20: {name} Dice at equal epochs within 0.02 of bsp-none ({d:+.3f})", d >= -0.02)
                )
        if "bsp-fixed4" in q:
            x = q["bsp-fixed4"]["bytes_x"]
            checks.append(
                (
                    f"wan20: bsp-fixed4 measured WAN bytes per epoch <= 1/7 of bsp-none (got {_fmt(x)})",
                    x is not None and x <= 1 / 7,
                )
            )
        for name, cc in c.items():
            if cc["max_lead_rounds"] is not None:
                checks.append(
                    (
                        f"wan20: {name} measured lead {cc['max_lead_rounds']} <= s = {cc['staleness_bound']}",
                        cc["max_lead_rounds"] <= cc["staleness_bound"],
                    )
                )
        if (
            "gssp" in c
            and c["gssp"]["insite_step_s_idle"]
            and c["gssp"]["insite_step_s_with_round_in_flight"]
        ):
            x = c["gssp"]["insite_step_s_with_round_in_flight"] / c["gssp"]["insite_step_s_idle"]
            checks.append(
                (f"wan20: gssp in-site step with a round in flight <= 1.15x idle (got {x:.2f}x)", x <= 1.15)
            )
    lan = result["scenarios"].get("lan")
    if lan:
        q = ratios(lan)
        for name in ("gssp", "gssp-fixed4"):
            if name in q and q[name]["speed_x"] is not None:
                checks.append(
                    (
                        f"lan: {name} samples/s >= 0.9x bsp-none (got {q[name]['speed_x']:.2f}x)",
                        q[name]["speed_x"] >= 0.9,
                    )
                )
    return checks


def _fmt(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.2f}x"


def format_table(result: dict[str, Any]) -> str:
    lines = []
    for scenario, res in result["scenarios"].items():
        q = ratios(res)
        lines += [
            f"**{scenario}** (WAN {res['wan']}; probe: RTT {res['rtt_ms']:.1f} ms, {res['mbit_s']:.1f} Mbit/s; budget {res['budget_s']:.0f} s)",
            "",
            f"| config | time to Dice {result['dice_target']} (s) | x bsp-none | from launch (s) | Dice equal epochs | Dice at budget | samples/s (whole job) | "
            "epochs run | WAN payload measured, MB (per epoch) | reported (MB) | measured/reported | max lead (s) | in-site step idle / in flight (s) | groups, rounds (steps) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, c in res["configs"].items():
            r = q[name]
            t = f"{c['time_to_dice_s']:.0f}" if c["time_to_dice_s"] else "not reached"
            lead = "-" if c["max_lead_rounds"] is None else f"{c['max_lead_rounds']} ({c['staleness_bound']})"
            step = (
                f"{c['insite_step_s_idle']:.3f} / {c['insite_step_s_with_round_in_flight']:.3f}"
                if c["insite_step_s_idle"] and c["insite_step_s_with_round_in_flight"]
                else "-"
            )
            mr = c["wan_payload_measured"] / c["wan_bytes_reported"] if c["wan_bytes_reported"] else None
            label = f"{name} (earlier run)" if c.get("reused") else name
            lines.append(
                f"| {label} | {t} | {_fmt(r['time_x'])} | {_fmt_s(c.get('time_to_dice_job_s'))} | {c['dice_equal_epochs']:.3f} | {_fmt_d(c['dice_at_budget'])} | "
                f"{c['samples_per_s']:.2f} | {c['epochs']} | {c['wan_payload_measured'] / 1e6:.1f} ({c['wan_payload_per_epoch'] / 1e6:.2f}) | {c['wan_bytes_reported'] / 1e6:.1f} | "
                f"{'-' if mr is None else f'{mr:.2f}'} | {lead} | {step} | {c['groups']}, {c['periods']} |"
            )
        earlier = sorted(
            {
                f"RTT {p['rtt_ms']:.1f} ms, {p['mbit_s']:.1f} Mbit/s"
                for c in res["configs"].values()
                if (p := c.get("reused_probe"))
            }
        )
        if earlier:
            lines += [
                "",
                "Configs marked 'earlier run' come from an earlier invocation (`--reuse`), same settings, "
                f"measured under its own probe ({'; '.join(earlier)}).",
            ]
        lines += [
            "",
            "Time per rank, summed over epochs (compute / waiting in site / waiting on other sites / wall, s):",
            "",
        ]
        for name, c in res["configs"].items():
            parts = "; ".join(
                f"r{i}: {t['compute_s']:.0f}/{t['site_s']:.0f}/{t['wan_wait_s']:.0f}/{t['wall_s']:.0f}"
                for i, t in enumerate(c["rank_time"])
            )
            lines.append(f"- {name}: {parts}")
        lines.append("")
        gaps = byte_gaps(res)
        if gaps:
            lines += [
                "Measured vs reported WAN bytes (TCP payload; headers counted by the relay):",
                "",
                *gaps,
                "",
            ]
    return "\n".join(lines)


#: What crosses the WAN outside the algorithms' byte models (``wan_bytes_reported``), for the report.
UNMODELLED = (
    "Horovod, once initialised, keeps exchanging coordination messages between all ranks even with no "
    "op pending (its background loop syncs its response cache every cycle, CacheCoordinator::sync; "
    "measured idle between the sites: 88-93 kB per 20 s), and negotiates every Horovod op through "
    "rank 0 (tensor names, sizes): bsp-none and bsp-fp16 run their gradient allreduce on Horovod, "
    "bsp-fixed4 between sites and the others run on medseg's channel and only idle on Horovod; "
    "medseg's channel sends control messages (a barrier, a metrics gather and the stop decision per "
    "epoch, about 5 kB; group set-up through rank 0's TCP store, about 20-40 kB per job); "
    "Gloo frames every message with a small header of its own"
)


def byte_gaps(res: dict[str, Any]) -> list[str]:
    """One line per config: measured TCP payload against the reported bytes, and what makes the gap.

    Retransmitted payload is measured by the relay (a segment whose sequence range was sent before);
    the rest of the gap is what :data:`UNMODELLED` lists, with its rate over the job's wall time
    (most of it runs whether or not a step is under way: measured with Horovod initialised and idle
    between the sites, 88-93 kB per 20 s crossed the WAN at 20 Mbit/s, 25 ms).
    """
    if res["wan"] == "none":
        return []
    out = []
    for name, c in res["configs"].items():
        rep, meas = c["wan_bytes_reported"], c["wan_payload_measured"]
        if not rep:
            continue
        retrans = c.get("wan_retrans_measured")
        rest = meas - rep - (retrans or 0)
        job_s = max(c.get("job_s") or 1.0, 1.0)
        steps = max(c.get("steps") or 1, 1)
        agree = abs(meas - rep) / rep
        why = (
            f"{'within' if agree <= 0.05 else 'NOT within'} 5 %; "
            + (f"TCP retransmissions {retrans / 1e6:.2f} MB, " if retrans is not None else "")
            + f"the rest {rest / 1e6:+.2f} MB ({rest / job_s / 1e3:+.1f} kB per second of the job, "
            f"{rest / steps / 1e3:+.1f} kB per step)"
        )
        out.append(
            f"- {name}: measured {meas / 1e6:.2f} MB, reported {rep / 1e6:.2f} MB ({(meas - rep) / rep:+.1%}): {why}"
        )
    if out:
        out.append(f"- not in the byte models: {UNMODELLED}.")
    return out


def _fmt_s(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.0f}"


def _fmt_d(d: float | None) -> str:
    return "-" if d is None else f"{d:.3f}"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = list(result["scenarios"])
    fig, axes = plt.subplots(1, len(scen), figsize=(5 * len(scen), 3.8), dpi=100, squeeze=False)
    for ax, s in zip(axes[0], scen):
        for name, c in result["scenarios"][s]["configs"].items():
            pts = [(t, d) for t, d in c["curve"] if d is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", ms=3, label=name)
        ax.axhline(result["dice_target"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{s} ({result['scenarios'][s]['wan']})")
        ax.set_xlabel("training wall time, validation excluded (s)")
        ax.set_ylabel("validation Dice")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(result: dict[str, Any], json_out: Path, markdown: Path | None) -> None:
    intro = (
        f"## Between hospitals: `medseg bench sites{' --quick' if result['quick'] else ''}`\n\n"
        f"2 emulated sites x 2 ranks (network namespaces, sshd per site, horovodrun over ssh), site b at half "
        f"the CPU of site a (cgroup quotas 0.5 and 0.25 core per rank), {result['epochs']} equal epochs (then up to "
        f"{MAX_EPOCHS_FACTOR * result['epochs']} until the Dice target), "
        f"{result['seeds']} seed(s), same data and model for every config. Ratios are against bsp-none in the same "
        f"scenario. Time to Dice is training wall time: from rank 0's start of training (speed and WAN profiling "
        f"included) to the first epoch whose held-out validation reaches the target, the validations themselves "
        f"excluded; 'from launch' adds start-up (ssh launch, imports, data caching), the same work for every config. "
        f"Samples/s is over the whole job. {result.get('setting', {}).get('note', '')}"
        + (
            f" With {result['seeds']} seed(s) the Dice at equal epochs is shown, not judged: the 0.02 band "
            f"against bsp-none is checked on the mean of {MIN_SEEDS_FOR_DICE_BAND} seeds (the seeded run)."
            if result["seeds"] < MIN_SEEDS_FOR_DICE_BAND
            else ""
        )
    )
    # the quick run and the seeded run keep separate sections (and plots) of the markdown file
    tag = "sites" if result["quick"] else "sites-full"
    publish(result, json_out, markdown, tag, plot, check_targets(result), intro, format_table(result))
