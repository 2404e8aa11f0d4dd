"""Planner measurements for docs/benchmarks.md: --verify error per network, fused vs unfused patch.

    .venv/bin/python scripts/bench_plan.py DATASET --json OUT.json [--nets unet segresnet dynunet]

For each network: ``medseg plan --net NET --memory-gb G --time-s 0 --verify`` (a memory budget that
binds, no time limit), i.e. the memory model measured at two probe patches for each network topology
the search meets (``probe_runs`` processes), the patch fitted to the budget, and two training steps
measured at that patch. Then UNet planned with and without ``--fused``
at the same budget: the ratio of the planned patch volumes. Each measurement runs in its own process
(medseg.kernels.measure); the numbers depend on the CPU's instruction set, not on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from medseg.planning.plan_io import format_verify, verify
from medseg.planning.planner import plan

BUDGET_GB = {"unet": 0.1, "segresnet": 0.25, "dynunet": 1.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset", type=Path)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--nets", nargs="+", default=list(BUDGET_GB), choices=list(BUDGET_GB))
    p.add_argument("--fused-budget-gb", type=float, default=0.1)
    p.add_argument("--skip-fused", action="store_true")
    args = p.parse_args()
    out: dict = {"dataset": str(args.dataset), "verify": {}, "fused": None}
    for net in args.nets:
        t0 = time.monotonic()
        pl = plan(
            args.dataset,
            memory_gb=BUDGET_GB[net],
            device="cpu",
            net=net,
            time_s=0,
            name=f"bench-{net}",
            report=print,
        )
        v = verify(pl)
        v["plan_s"] = round(time.monotonic() - t0, 1)
        v["probes"] = [vars(pr) for pr in pl.memory.probes]
        v["topology"] = pl.memory.topology
        v["probe_runs"], v["topologies"] = pl.probe_runs, pl.topologies
        out["verify"][net] = v
        print(format_verify(v), f"({pl.probe_runs} probe runs, {pl.topologies} topologies)", flush=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if not args.skip_fused:
        res = {}
        for fused in (False, True):
            pl = plan(
                args.dataset,
                memory_gb=args.fused_budget_gb,
                device="cpu",
                net="unet",
                time_s=0,
                fused=fused,
                report=print,
            )
            v = verify(pl)
            res["fused" if fused else "baseline"] = {
                "patch": pl.config["transforms"]["patch"],
                "batch": pl.config["train"]["batch_size"],
                "voxels": math.prod(pl.config["transforms"]["patch"]),
                "bytes_per_batch_voxel": pl.memory.b,
                "verify": v,
            }
            print(
                f"{'fused' if fused else 'baseline'}: {res['fused' if fused else 'baseline']['patch']}; {format_verify(v)}"
            )
        res["volume_ratio"] = res["fused"]["voxels"] / res["baseline"]["voxels"]
        res["budget_gb"] = args.fused_budget_gb
        out["fused"] = res
        print(f"fused / baseline planned patch volume: {res['volume_ratio']:.2f}x", flush=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
