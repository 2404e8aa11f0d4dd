"""``medseg bench comm``: the synchronisation modes side by side with plain Horovod, in one run.

Every configuration trains the same small UNet on the same synthetic data with the same seed and
number of epochs, on 4 ranks of this machine under horovodrun, with rank 3 slowed down 2x
(``--straggler 3:2``). Reported per configuration: samples/s (all ranks' samples over the slowest
rank's epoch time), seconds per epoch, bytes sent per worker per step (analytical per-worker
volume of the collectives used, see medseg.distributed.collectives), validation Dice after the last
epoch, and the largest staleness observed. Ratios are against ``bsp-none`` measured in the same run.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from medseg.config import config_from_dict
from medseg.datasets.synthetic import make_seg_dataset
from medseg.distributed.launcher import launch
from medseg.report import publish
from medseg.runlog import read_metrics

log = logging.getLogger(__name__)

CONFIGS: dict[str, dict[str, Any]] = {
    "bsp-none": {"sync": "bsp"},
    "bsp-fp16": {"sync": "bsp", "compression": "fp16"},
    "gssp": {"sync": "gssp", "groups": [[0, 1, 2], [3]], "staleness": 2},
    "bsp-fixed4": {"sync": "bsp", "compression": "fixed", "bits": 4},
    "gssp-fixed4": {
        "sync": "gssp",
        "groups": [[0, 1, 2], [3]],
        "staleness": 2,
        "compression": "fixed",
        "bits": 4,
    },
}
TARGETS = "gssp >= 1.5x bsp-none samples/s; bsp-fixed4 bytes <= 1/7 bsp-none and <= 1/3.5 bsp-fp16; Dice >= bsp-none - 0.02; max_staleness <= s"


def _config(name: str, dist: dict[str, Any], data_dir: Path, runs_dir: Path, epochs: int) -> Any:
    return config_from_dict(
        {
            "name": name,
            "task": "segmentation",
            "runs_dir": str(runs_dir),
            "data": {"dir": str(data_dir), "val_fraction": 0.2, "cache": "memory"},
            "transforms": {
                "spacing": [1.6, 1.6, 2.4],
                "window": [-150, 250],
                "patch": [16, 16, 16],
                "num_samples": 2,
            },
            "model": {"name": "unet", "channels": [16, 32, 64], "strides": [2, 2], "num_res_units": 1},
            "train": {
                "epochs": epochs,
                "batch_size": 1,
                "lr": 0.005,
                "seed": 0,
                "threads": 1,
                "scheduler": "none",
            },
            "dist": {"timeout_s": 120, "profile_steps": 8, **dist},
        }
    )


def bench_comm(workdir: Path, quick: bool = False, np_: int = 4, straggler: str = "3:2") -> dict[str, Any]:
    """Run every configuration; return ``{"configs": {NAME: {...}}, ...}``."""
    workdir.mkdir(parents=True, exist_ok=True)
    cases, epochs = (40, 3) if quick else (128, 8)
    data_dir = make_seg_dataset(workdir / "data", n_train=cases, n_test=0, seed=7, size=48)
    runs_dir = workdir / "runs"
    results: dict[str, Any] = {}
    for name, dist in CONFIGS.items():
        cfg = _config(name, dist, data_dir, runs_dir, epochs)
        config_path = runs_dir / f"{name}.yaml"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        config_path.write_text(yaml.safe_dump(cfg.to_dict()))
        tic = time.perf_counter()
        launch(cfg, config_path, [], np_, None, False, straggler)
        records = read_metrics(cfg.run_dir / "metrics.jsonl")
        total_s = sum(r["dist_epoch_s"] for r in records)
        results[name] = {
            "samples_per_s": sum(r["dist_samples_per_s"] * r["dist_epoch_s"] for r in records) / total_s,
            "epoch_s": total_s / len(records),
            "bytes_per_step": sum(r["dist_bytes_per_step"] for r in records) / len(records),
            "dice": records[-1].get("val_dice"),
            "max_staleness": max(r["dist_max_staleness"] for r in records),
            "staleness_bound": dist.get("staleness") if dist["sync"] == "gssp" else 0,
            "groups": records[-1]["dist_groups"],
            "curve": [
                (sum(x["dist_epoch_s"] for x in records[: i + 1]), r.get("val_dice"))
                for i, r in enumerate(records)
            ],
            "job_s": time.perf_counter() - tic,
        }
        log.info("%s: %s", name, {k: v for k, v in results[name].items() if k != "curve"})
    return {
        "np": np_,
        "straggler": straggler,
        "epochs": epochs,
        "cases": cases,
        "quick": quick,
        "configs": results,
    }


def ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    c = result["configs"]
    base, fp16 = c["bsp-none"], c["bsp-fp16"]
    out = {}
    for name, r in c.items():
        out[name] = {
            "speed_x": r["samples_per_s"] / base["samples_per_s"],
            "bytes_vs_fp32": r["bytes_per_step"] / base["bytes_per_step"],
            "bytes_vs_fp16": r["bytes_per_step"] / fp16["bytes_per_step"],
            "dice_delta": (r["dice"] or 0.0) - (base["dice"] or 0.0),
        }
    return out


def format_table(result: dict[str, Any]) -> str:
    rat = ratios(result)
    lines = [
        "| config | samples/s | x bsp-none | s/epoch | bytes/step/worker | vs fp32 | vs fp16 | Dice | Dice - bsp | max staleness | groups |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["configs"].items():
        q = rat[name]
        lines.append(
            f"| {name} | {r['samples_per_s']:.2f} | {q['speed_x']:.2f} | {r['epoch_s']:.1f} | {r['bytes_per_step']:,.0f} | "
            f"{q['bytes_vs_fp32']:.3f} | {q['bytes_vs_fp16']:.3f} | {r['dice']:.3f} | {q['dice_delta']:+.3f} | "
            f"{r['max_staleness']} (s={r['staleness_bound']}) | {r['groups']} |"
        )
    return "\n".join(lines)


def check_targets(result: dict[str, Any]) -> list[tuple[str, bool]]:
    c, q = result["configs"], ratios(result)
    return [
        ("gssp samples/s >= 1.5x bsp-none", q["gssp"]["speed_x"] >= 1.5),
        ("gssp-fixed4 samples/s >= 1.5x bsp-none", q["gssp-fixed4"]["speed_x"] >= 1.5),
        ("bsp-fixed4 bytes/step <= 1/7 of bsp-none", q["bsp-fixed4"]["bytes_vs_fp32"] <= 1 / 7),
        ("bsp-fixed4 bytes/step <= 1/3.5 of bsp-fp16", q["bsp-fixed4"]["bytes_vs_fp16"] <= 1 / 3.5),
        *[
            (f"{n} Dice >= bsp-none - 0.02", q[n]["dice_delta"] >= -0.02)
            for n in ("gssp", "bsp-fixed4", "gssp-fixed4")
        ],
        *[
            (f"{n} max staleness <= s", c[n]["max_staleness"] <= c[n]["staleness_bound"])
            for n in ("gssp", "gssp-fixed4")
        ],
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    a.bar(names, [result["configs"][n]["samples_per_s"] for n in names], color="tab:blue")
    a.set_ylabel("samples/s (4 ranks, rank 3 at 2x)")
    a.tick_params(axis="x", rotation=30)
    for n in names:
        pts = [(t, d) for t, d in result["configs"][n]["curve"] if d is not None]
        if pts:
            b.plot(*zip(*pts), "o-", label=n)
    b.set_xlabel("training wall time (s)")
    b.set_ylabel("validation Dice")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(result: dict[str, Any], json_out: Path, markdown: Path | None) -> None:
    rank, factor = result["straggler"].split(":")
    intro = (
        f"## Communication: `medseg bench comm{' --quick' if result['quick'] else ''}`\n\n"
        f"{result['np']} ranks on this machine under horovodrun (Gloo), rank {rank} slowed {factor}x, "
        f"{result['epochs']} epochs of a small UNet on {result['cases']} synthetic cases, same seed. "
        f"Ratios are against bsp-none from the same run."
    )
    publish(result, json_out, markdown, "comm", plot, check_targets(result), intro, format_table(result))
