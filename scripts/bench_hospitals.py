"""Three unlike hospitals: each alone, pooled, bsp, gssp and gssp with local_norm (FedBN).

Usage: ``.venv/bin/python scripts/bench_hospitals.py --workdir runs/bench-hospitals
--markdown docs/benchmarks.md`` (``--quick`` for a smoke run). Sites come from the ``3-sites``
preset of ``medseg data synth-sites`` (unlike intensities, noise, bias fields, voxel sizes,
orientations and case mixes), each with labelled held-out cases it never trains on.

Every configuration trains through ``medseg train`` and is scored the same way, with
``medseg evaluate``'s per-site table (:func:`medseg.inference.evaluate.evaluate_sites`) on each site's own
held-out cases, in their original geometry; local_norm bundles are scored at each site with that
site's own normalisation tensors. The distributed runs keep each site's data in its own folder
(``sites:``), one rank per site, on this one machine (three local host names, so horovodrun starts
them without ssh; real namespaces and a shaped WAN are ``medseg sites``' job, not this benchmark's:
here the question is accuracy, not time). A canary run of voxel values is planted in one of site
a's training images and every rank's audit log is searched for it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CANARY = [17, -93, 201, 3, -141, 77, 239, -11, 143, 59, -127, 211]
SITES = ("a", "b", "c")


def local_hosts() -> list[str]:
    """Three names of this machine that horovodrun treats as local (no ssh): one per site."""
    import psutil

    own = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not own:
        raise SystemExit("needs a non-loopback IPv4 address on this machine for the third site")
    return ["localhost", "127.0.0.1", own[0]]


def plant_canary(image: Path) -> None:
    """Write the canary run along z through the middle of one image (int16 voxels)."""
    img = nib.load(image)
    data = np.asarray(img.dataobj).copy()
    x, y = data.shape[0] // 2, data.shape[1] // 2
    n = min(len(CANARY), data.shape[2])
    data[x, y, :n] = CANARY[:n]  # contiguous in C-ordered tensors
    data[: len(CANARY), y // 2, 1] = CANARY  # and in NIfTI's file order (x fastest)
    nib.save(nib.Nifti1Image(data, img.affine, img.header), image)


def make_data(work: Path, cases: int, test: int, size: int) -> dict[str, dict[str, Path]]:
    from medseg.datasets.decathlon import load_dataset, write_dataset_json
    from medseg.datasets.synthetic import make_site_datasets

    data = work / "data"
    if not (data / "pooled" / "dataset.json").is_file():
        shutil.rmtree(data, ignore_errors=True)
        made = make_site_datasets(data, "3-sites", cases, test, seed=0, size=size)
        plant_canary(Path(load_dataset(made["a"]["train"]).training[0]["image"]))
        # the pooled upper bound: every site's training cases in one place (links, same files)
        training = []
        for site in SITES:
            for item in load_dataset(data / site).training:
                entry = {}
                for key in ("image", "label"):
                    src = Path(item[key])
                    dest = data / "pooled" / src.parent.name / f"{site}_{src.name}"
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.symlink_to(src)
                    entry[key] = f"./{src.parent.name}/{dest.name}"
                training.append(entry)
        info = json.loads((data / "a" / "dataset.json").read_text())
        info.update(name="pooled", training=training, test=[], numTraining=len(training), numTest=0)
        write_dataset_json(data / "pooled", info)
    return {s: {"train": data / s, "test": data / f"{s}-test"} for s in SITES}


def base_config(work: Path, epochs: int, val_interval: int) -> dict:
    return {
        "task": "segmentation",
        "runs_dir": str(work / "runs"),
        "data": {"val_fraction": 0.2, "cache": "memory"},
        "transforms": {
            "spacing": [1.2, 1.2, 2.4],
            "window": [-150, 250],
            "patch": [24, 24, 16],
            "num_samples": 4,
        },
        "model": {
            "name": "unet",
            "channels": [8, 16, 32],
            "strides": [2, 2],
            "num_res_units": 1,
            "norm": "batch",
        },
        "train": {
            "epochs": epochs,
            "batch_size": 2,
            "lr": 0.01,
            "seed": 0,
            "threads": 1,
            "scheduler": "cosine",
        },
        "infer": {"sw_batch_size": 8},
    }


def run(name: str, cfg: dict, work: Path, np_: int = 0, hosts: str = "") -> dict:
    cfg = {**cfg, "name": name}
    path = work / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    argv = [str(BIN / "medseg"), "train", "--config", str(path), "--no-progress"]
    if np_:
        argv += ["--np", str(np_), "--hosts", hosts]
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", MEDSEG_AUDIT_CANARY=",".join(map(str, CANARY)))
    env["MEDSEG_AUDIT_WINDOW"] = "-150,250"
    tic = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    took = time.time() - tic
    (work / "runs" / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    print(f"{name}: trained in {took:.0f} s", flush=True)
    return {"train_s": round(took, 1)}


def score(name: str, work: Path, sites: dict[str, dict[str, Path]]) -> dict:
    from medseg.distributed.comm.audit import summarize
    from medseg.inference.evaluate import evaluate_sites

    run_dir = work / "runs" / name
    result = evaluate_sites(run_dir, [(s, d["test"]) for s, d in sites.items()], progress=False)
    out = {
        "dice": {s: m["dice"] for s, m in result["sites"].items()},
        "pooled_cases_dice": result["pooled"]["dice"],
    }
    out["mean_site_dice"] = sum(out["dice"].values()) / len(out["dice"])
    if (run_dir / "audit").is_dir():
        out["audit"] = summarize(run_dir)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-hospitals")
    ap.add_argument(
        "--epochs",
        type=int,
        default=90,
        help="epochs of every configuration (90: at 30 every configuration was still improving)",
    )
    ap.add_argument("--cases", type=int, default=10, help="training cases per site")
    ap.add_argument("--test", type=int, default=6, help="held-out cases per site")
    ap.add_argument("--size", type=int, default=48)
    ap.add_argument(
        "--val-interval", type=int, default=30, help="epochs between validations (checkpoint choice)"
    )
    ap.add_argument("--quick", action="store_true", help="3 epochs, 4 cases, 2 held out: a smoke run")
    ap.add_argument("--only", nargs="+", help="configurations to run (default all)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.epochs, args.cases, args.test = 3, 4, 2
    work = args.workdir.resolve()
    sites = make_data(work, args.cases, args.test, args.size)
    base = base_config(work, args.epochs, args.val_interval)
    hosts = local_hosts()
    site_cfg = {s: {"dir": str(d["train"]), "host": h} for (s, d), h in zip(sites.items(), hosts)}
    # The sites run on the same (loaded) cores: rounds of one step each, not speeds measured under noise.
    dist = {"timeout_s": 300, "profile_steps": 2, "staleness": 1, "periods": [1, 1, 1]}
    plans = {
        f"alone-{s}": ({**base, "data": {**base["data"], "dir": str(sites[s]["train"])}}, 0) for s in SITES
    }
    plans["pooled"] = ({**base, "data": {**base["data"], "dir": str(work / "data" / "pooled")}}, 0)
    for name, extra in (
        ("bsp", {"sync": "bsp"}),
        ("gssp", {"sync": "gssp"}),
        ("gssp-local-norm", {"sync": "gssp", "local_norm": True}),
    ):
        plans[name] = ({**base, "sites": site_cfg, "dist": {**dist, **extra}}, len(SITES))
    results_path = args.json or work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() and args.only else {}
    for name, (cfg, np_) in plans.items():
        if args.only and name not in args.only:
            continue
        r = run(name, cfg, work, np_, ",".join(f"{s}:1" for s in SITES))
        r.update(score(name, work, sites))
        results[name] = r
        print(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'audit'})}", flush=True)
        results_path.write_text(json.dumps(results, indent=2) + "\n")
    meta = {
        "epochs": args.epochs,
        "cases": args.cases,
        "test": args.test,
        "size": args.size,
        "val": args.val_interval,
    }
    if args.markdown:
        write_markdown(args.markdown, results, meta)


def write_markdown(markdown: Path, results: dict, meta: dict) -> None:
    from medseg.bench.report import replace_section

    rows = [
        "| configuration | Dice a | Dice b | Dice c | mean per site | all held-out cases | train s | sent to other sites (MB) | canary hits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        a = r.get("audit")
        sent = f"{sum(sum(k.values()) for k in a['sites'].values()) / 1e6:.1f}" if a else "-"
        hits = str(a["canary_hits"]) if a else "-"
        d = r["dice"]
        rows.append(
            f"| {name} | {d['a']:.3f} | {d['b']:.3f} | {d['c']:.3f} | {r['mean_site_dice']:.3f} | "
            f"{r['pooled_cases_dice']:.3f} | {r['train_s']:.0f} | {sent} | {hits} |"
        )
    checks = []
    if {"gssp-local-norm", "pooled"} <= set(results):
        gap = results["pooled"]["mean_site_dice"] - results["gssp-local-norm"]["mean_site_dice"]
        checks.append(
            (
                f"gssp+local_norm mean per-site Dice within 0.03 of pooled (pooled minus it: {gap:+.3f})",
                gap <= 0.03,
            )
        )
        for s in SITES:
            if f"alone-{s}" in results:
                mine, alone = results["gssp-local-norm"]["dice"][s], results[f"alone-{s}"]["dice"][s]
                checks.append(
                    (
                        f"gssp+local_norm beats site {s} alone on {s}'s held-out cases ({mine:.3f} vs {alone:.3f})",
                        mine > alone,
                    )
                )
    audited = [r for r in results.values() if r.get("audit")]
    if audited:
        hits = sum(r["audit"]["canary_hits"] for r in audited)
        kinds = sorted({k for r in audited for k in r["audit"]["kinds"]})
        checks.append(
            (
                f"no image or label bytes left any site: canary found {hits} times in {sum(r['audit']['messages'] for r in audited)} logged messages; kinds sent: {', '.join(kinds)}",
                hits == 0,
            )
        )
    lines = "\n".join(f"- {'met' if ok else 'MISSED'}: {text}" for text, ok in checks)
    intro = (
        "Three unlike hospitals (`medseg data synth-sites --preset 3-sites`: site b at 0.75x intensity, "
        "-50 HU, noise 35, bias 0.15, 0.9 mm, RAS, 30 % small-structure cases; site c at 1.25x, +40 HU, "
        "noise 25, bias 0.3, 0.7 mm, LAS, 60 % small), "
        f"{meta['cases']} training and {meta['test']} held-out cases per site, {meta['size']}-voxel volumes, "
        f"tiny UNet (8-16-32, BatchNorm), {meta['epochs']} epochs (best of a validation every {meta['val']}), one rank per site on this 2-core machine "
        "(`scripts/bench_hospitals.py`). Dice: mean foreground Dice of `medseg evaluate` on each site's "
        "held-out cases in original geometry (local_norm: with that site's own normalisation). "
        "'mean per site' averages the three sites; 'all held-out cases' averages every case. "
        "Bytes: what each site's audit log recorded as sent to other sites or the launcher."
    )
    replace_section(markdown, "hospitals", f"{intro}\n\n" + "\n".join(rows) + f"\n\n{lines}")


if __name__ == "__main__":
    main()
