"""medseg against nnU-Net v2 on real MR (Task04_Hippocampus), side by side on the same CPU cores.

    .venv/bin/python scripts/bench_real.py medseg --budgets 15,60 --seeds 0 [--variants planned,nnunet-aug]
    .venv/bin/python scripts/bench_real.py nnunet --trainers nnUNetTrainer_1epoch --seeds 0
    .venv/bin/python scripts/bench_real.py report --markdown docs/benchmarks.md --plot docs/bench-real.png

Split (``scripts/real_split.py``): 40 of the 200 cases held out by a fixed shuffle, never trained or
selected on; each system trains on the same 128 and monitors the same 32 of the other 160. Every
result is appended to ``--json`` (default ``docs/bench-real.json``) with the code's commit and the
load average before and after, so ``report`` can show what ran where.

medseg: ``medseg plan`` on the training folder with ``--time-s`` = half the CPU budget (2 cores),
then ``medseg train`` with the variant's overrides, then ``medseg evaluate`` on the held-out folder
three ways (as trained; with test-time mirroring; with mirroring and largest components kept).
nnU-Net: ``scripts/real_nnunet.py`` (its own venv, a shipped fixed-length trainer, ``-device cpu``,
its default prediction). Dice of nnU-Net's held-out predictions is MONAI's ``DiceMetric`` on the
label's grid, as ``medseg evaluate`` computes it. CPU seconds are user + system of the whole process
tree (``RUSAGE_CHILDREN``); the training figure includes each system's own validation during
training, not planning, preprocessing or held-out inference (reported beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_nnunet  # noqa: E402
from real_split import Split, link_folder, make_split  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEDSEG = ROOT / ".venv" / "bin" / "medseg"
NNUNET_BIN = ROOT / ".venv-nnunet" / "bin"

#: nnU-Net's optimiser: SGD, Nesterov momentum 0.99, lr 0.01, weight decay 3e-5, poly schedule
SGD_POLY = [
    "train.optimizer=sgd", "train.momentum=0.99", "train.lr=0.01", "train.weight_decay=3e-5", "train.scheduler=poly"
]  # fmt: skip
#: recipe variants: train-time overrides of the planned config
VARIANTS = {
    "planned": [],
    "nnunet-aug": ["transforms.augment_recipe=nnunet"],
    "sgd-poly": SGD_POLY,
    "nnunet-aug-sgd-poly": ["transforms.augment_recipe=nnunet", *SGD_POLY],
    # nnU-Net's network (DynUNet, 32-320 features, its kernel/stride rule) without and with deep supervision
    "dynunet": ["model.name=dynunet"],
    "dynunet-ds": ["model.name=dynunet", "model.deep_supervision=2"],
    # the plan's UNet with a full-resolution level first (MONAI's UNet otherwise halves the patch in its
    # first convolution), mirrored left-right only (the hippocampus's anterior-posterior axis is not
    # symmetric), and the object placed anywhere within 8 voxels of where a tight crop would put it
    "fullres": ["model.channels=[16,16,32,64,128]", "model.strides=[1,2,2,2]", "transforms.flip_axes=[0]"],
}
VARIANTS["fullres-shift"] = [*VARIANTS["fullres"], "transforms.shift=8"]
# nnU-Net's network thinned to the plan's widths: DynUNet (two convolutions per level, full resolution
# first) at 16-128 features, with two deep-supervision heads, mirrored left-right only
VARIANTS["dynunet-thin-ds"] = [
    "model.name=dynunet", "model.filters=[16,32,64,128]", "model.deep_supervision=2", "transforms.flip_axes=[0]"
]  # fmt: skip
# fullres-shift trained on all 160 cases: no validation split, the last epoch is the model (as
# nnU-Net's final checkpoint), so nothing is selected on any case
VARIANTS["fullres-shift-all"] = [*VARIANTS["fullres-shift"], "data.val_fraction=0"]
VARIANTS["dynunet-thin-ds-shift-all"] = [
    *VARIANTS["dynunet-thin-ds"],
    "transforms.shift=8",
    "data.val_fraction=0",
]
#: inference-time variants: overrides given to ``medseg evaluate``; ``{flips}`` is the axes the run
#: was trained to see mirrored (its ``transforms.flip_axes``): mirroring an axis the network never saw
#: flipped (the hippocampus's anterior-posterior axis, say) swaps what it calls anterior and posterior
EVALS = {
    "as-trained": [],
    "mirror": ["infer.mirror={flips}"],
    "mirror-lcc": ["infer.mirror={flips}", "infer.keep_largest=true"],
}


def context() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    )
    return {
        "commit": commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else ""),
        "load": os.getloadavg()[0],
    }


def append(path: Path, entry: dict) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {"results": []}
    data["results"].append(entry)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(entry), flush=True)


def folders(source: Path, work: Path, seed: int, val_fraction: float = 0.2) -> tuple[Split, Path, Path]:
    """The split of ``seed`` and its training (train + val) and held-out folders under ``work``."""
    split = make_split(source, held_out=40, seed=seed, val_fraction=val_fraction)
    train_dir = link_folder(source, work / "data" / "train160", sorted(split.train + split.val))
    held_dir = link_folder(source, work / "data" / "heldout40", split.held_out)
    return split, train_dir, held_dir


def cpu_run(cmd: list[str], log: Path) -> float:
    return real_nnunet.cpu_of(cmd, dict(os.environ), log)


def evaluate_medseg(run: Path, held_dir: Path, log: Path) -> dict:
    """Held-out Dice of ``run`` under each of ``EVALS``, and the CPU seconds each evaluation took."""
    from medseg.config import load_config

    trained = load_config(run / "config.yaml").transforms
    flips = "[" + ",".join(str(a) for a in (trained.flip_axes if trained.augment else [])) + "]"
    out = {}
    for name, templates in EVALS.items():
        overrides = [o.format(flips=flips) for o in templates]
        cpu = cpu_run(
            [
                str(MEDSEG),
                "evaluate",
                "--run",
                str(run),
                "--data",
                str(held_dir),
                "--no-progress",
                *overrides,
            ],
            log,
        )
        result = json.loads((run / f"eval-{held_dir.name}.json").read_text())
        summary, keys = result["summary"], ("dice_Anterior", "dice_Posterior")
        out[name] = {
            "dice": summary["dice"],
            **{k: summary[k] for k in keys},
            "cpu_s": round(cpu, 1),
            "per_case": {k: [c[k] for c in result["cases"]] for k in keys},  # held-out case order
        }
    return out


def medseg_one(
    source: Path, work: Path, budget_min: float, seed: int, variant: str, epochs: int | None
) -> dict:
    val_fraction = next(
        (float(o.split("=", 1)[1]) for o in VARIANTS[variant] if o.startswith("data.val_fraction=")), 0.2
    )
    split, train_dir, held_dir = folders(source, work, seed, val_fraction)
    name = f"real-{variant}-{budget_min:g}min-s{seed}" + (f"-{epochs}ep" if epochs else "")
    cfg, log = work / f"real-plan-{budget_min:g}min.yaml", work / f"{name}.log"
    log.unlink(missing_ok=True)
    t0, ctx = time.time(), context()
    plan_cpu = 0.0  # one plan per budget, shared by its variants and seeds (its CPU counted once)
    if not cfg.is_file():
        plan_cpu = cpu_run(
            [str(MEDSEG), "plan", str(train_dir), "--out", str(cfg), "--time-s", str(budget_min * 30)], log
        )
    runs = ROOT / "runs"
    subprocess.run(["rm", "-rf", str(runs / name)], check=True)
    overrides = [f"name={name}", f"train.seed={seed}", *VARIANTS[variant]]
    if epochs:
        overrides += [f"train.epochs={epochs}", f"train.val_interval={max(1, epochs // 10)}"]
    train_cpu = cpu_run([str(MEDSEG), "train", "--config", str(cfg), "--no-progress", *overrides], log)
    wall = time.time() - t0
    evals = evaluate_medseg(runs / name, held_dir, log)
    return {
        **step_time(cfg, runs / name),
        "system": "medseg", "variant": variant, "budget_cpu_min": budget_min, "seed": seed, "epochs": epochs,
        "plan_cpu_s": round(plan_cpu, 1), "train_cpu_s": round(train_cpu, 1), "wall_s": round(wall, 1),
        "eval": evals, "config": str(cfg), **ctx, "load_end": os.getloadavg()[0],
        "train_cases": len(split.train), "val_cases": len(split.val), "held_out": len(split.held_out),
    }  # fmt: skip


def step_time(plan: Path, run_dir: Path) -> dict:
    """The plan's predicted wall seconds per step (its ``time:`` reason) and training's measured ones.

    Measured: the epochs' training seconds (``epoch_s``, data loading included, validation not) over
    their steps (the plan's steps per epoch)."""
    from medseg.training.runlog import read_metrics

    text = " ".join(plan.read_text().split())
    predicted = re.search(r"([0-9.]+) s/step x [0-9]+ steps", text)
    per_epoch = re.search(r"[0-9]+ steps of ([0-9]+) per epoch", text)
    records = read_metrics(run_dir / "metrics.jsonl")
    if not (predicted and per_epoch and records):
        return {}
    measured = sum(r["epoch_s"] for r in records) / (len(records) * int(per_epoch.group(1)))
    return {"plan_step_s": float(predicted.group(1)), "train_step_s": round(measured, 4)}


def nnunet_dice(pred_dir: Path, held_dir: Path) -> dict:
    """Mean held-out Dice per label of nnU-Net's predictions: MONAI's DiceMetric on the label grid."""
    import nibabel as nib
    import torch
    from monai.metrics import DiceMetric
    from monai.networks.utils import one_hot

    info = json.loads((held_dir / "dataset.json").read_text())
    labels = {int(k): v for k, v in info["labels"].items() if int(k) != 0}
    rows = []
    for case in info["training"]:
        ref = torch.as_tensor(nib.load(held_dir / case["label"]).get_fdata().round())[None, None]
        pred = torch.as_tensor(nib.load(pred_dir / Path(case["label"]).name).get_fdata().round())[None, None]
        k = max(labels) + 1
        d = DiceMetric(include_background=False, reduction="none")(one_hot(pred, k), one_hot(ref, k))[0]
        rows.append(d.tolist())
    names = [f"dice_{labels[c]}" for c in sorted(labels)]
    per = {k: sum(r[i] for r in rows) / len(rows) for i, k in enumerate(names)}
    cases = {k: [r[i] for r in rows] for i, k in enumerate(names)}
    return {"dice": sum(per.values()) / len(per), **per, "per_case": cases}


def nnunet_one(source: Path, work: Path, trainer: str, seed: int) -> dict:
    split, _, held_dir = folders(source, work, seed)
    nn_work, log = work / "nnunet", work / f"nnunet-{trainer}-s{seed}.log"
    log.unlink(missing_ok=True)
    from medseg.datasets.decathlon import load_dataset

    info = load_dataset(source)
    cases = {Path(c["image"]).name.removesuffix(".nii.gz"): c for c in info.training}
    env = real_nnunet.environment(nn_work)
    t0, ctx = time.time(), context()
    real_nnunet.write_raw(cases, split, info.labels, nn_work)
    prep_cpu = real_nnunet.plan_and_preprocess(NNUNET_BIN, env, log)
    real_nnunet.write_splits(split, nn_work)
    real_nnunet.clear_results(nn_work, trainer)
    train_cpu = real_nnunet.train(NNUNET_BIN, env, trainer, log)
    wall = time.time() - t0
    pred_dir, pred_cpu = real_nnunet.predict(NNUNET_BIN, env, trainer, nn_work, log)
    return {
        "system": "nnunet", "variant": trainer, "seed": seed, "plan_cpu_s": round(prep_cpu, 1),
        "train_cpu_s": round(train_cpu, 1), "wall_s": round(wall, 1),
        "eval": {"default": {**nnunet_dice(pred_dir, held_dir), "cpu_s": round(pred_cpu, 1)}},
        **ctx, "load_end": os.getloadavg()[0],
        "train_cases": len(split.train), "val_cases": len(split.val), "held_out": len(split.held_out),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["medseg", "nnunet", "report"])
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "Task04_Hippocampus")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "bench-real")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "bench-real.json")
    p.add_argument("--budgets", default="15", help="medseg: CPU minutes of training, comma-separated")
    p.add_argument("--variants", default="planned", help=f"medseg: comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--trainers", default="nnUNetTrainer_1epoch", help="nnunet: shipped trainer classes")
    p.add_argument("--seeds", default="0")
    p.add_argument(
        "--epochs",
        type=int,
        help="medseg: train this many epochs instead of the plan's (its steps come from --time-s's step-time "
        "model, which probes cached under load overestimate); chosen from a run's measured CPU per epoch",
    )
    p.add_argument("--markdown", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    if args.stage == "report":
        from real_report import report

        report(args.json, args.markdown, args.plot)
        return
    if not (args.data / "dataset.json").is_file():
        sys.exit(f"{args.data}: no dataset.json; the benchmark needs Task04_Hippocampus (../shared/data)")
    args.work.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.stage == "medseg":
        for budget in (float(b) for b in args.budgets.split(",")):
            for variant in args.variants.split(","):
                for seed in seeds:
                    append(args.json, medseg_one(args.data, args.work, budget, seed, variant, args.epochs))
    else:
        if not (NNUNET_BIN / "nnUNetv2_train").exists():
            sys.exit("nnU-Net v2 is not installed: run `make nnunet-deps` (its own venv, .venv-nnunet)")
        for trainer in args.trainers.split(","):
            for seed in seeds:
                append(args.json, nnunet_one(args.data, args.work, trainer, seed))


if __name__ == "__main__":
    main()
