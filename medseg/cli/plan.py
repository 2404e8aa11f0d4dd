"""``medseg plan``: fingerprint a dataset and write a config fitted to it and to a budget."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medseg.errors import ConfigError

if TYPE_CHECKING:
    from medseg.planning.planner import Plan


def _plan_document(p: Plan) -> dict[str, Any]:
    """``--json``'s content: the config, its comments, the predictions and what was measured."""
    return {
        "config": p.config,
        "comments": p.comments,
        "predicted_total_bytes": p.predicted_total,
        "predicted_step_peak_bytes": p.predicted_step_peak,
        "predicted_step_s": p.predicted_step_s,
        "budget_bytes": p.budget_bytes,
        "params": p.params,
        "verify": p.verify,
        "probes": [vars(pr) for pr in p.memory.probes] if p.memory else None,
        "topology": p.memory.topology if p.memory else None,
        "probe_runs": p.probe_runs,
    }


def _plan(args: argparse.Namespace) -> None:
    from medseg.planning.plan_io import format_verify, verify, write_plan
    from medseg.planning.planner import plan

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() and (args.verify or args.memory_gb is None):
            raise ConfigError(
                "--device cuda: torch sees no CUDA device here, and the memory model is measured on the "
                "device; plan on the GPU machine, or use --device cpu"
            )
    p = plan(
        args.dataset,
        memory_gb=args.memory_gb,
        device=args.device,
        fused=args.fused,
        net=args.net,
        time_s=-1.0 if args.time_s is None else args.time_s,
        steps=args.steps,
        name=args.name,
        refresh=args.refresh,
        report=lambda text: print(text, flush=True),
    )
    if args.verify:
        print(format_verify(verify(p)))
    out = write_plan(p, args.out)
    cfg = p.config
    print(
        f"plan: {cfg['model']['name']}, spacing {cfg['transforms']['spacing']} mm, patch {cfg['transforms']['patch']}, "
        f"batch {cfg['train']['batch_size']} case(s) x {cfg['transforms']['num_samples']} patches, "
        f"{cfg['train']['epochs']} epochs, "
        f"normalisation {cfg['transforms']['normalize']['scheme']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(_plan_document(p), indent=1) + "\n")
    print(f"wrote {out}; train with: medseg train --config {out}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``medseg plan``."""
    s = subparsers.add_parser(
        "plan",
        help="fingerprint a dataset and write a config fitted to it and to a memory (and time) budget",
    )
    s.add_argument("dataset", type=Path, help="dataset folder (dataset.json, Decathlon layout)")
    s.add_argument("--out", type=Path, required=True, help="config YAML to write, e.g. configs/NAME.yaml")
    s.add_argument(
        "--memory-gb",
        type=float,
        help="memory budget of a training step (default: half the free RAM up to 8, or 90%% of the GPU)",
    )
    s.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where it will train (and is measured)"
    )
    s.add_argument(
        "--fused", action="store_true", help="plan for train.memory=fused (measured with the fused kernels)"
    )
    s.add_argument(
        "--net", choices=["unet", "segresnet", "dynunet"], help="default: unet on cpu, dynunet on cuda"
    )
    s.add_argument(
        "--time-s",
        type=float,
        help="wall seconds of training the plan must fit; without --steps the steps fill 80%% of it "
        "(default on cpu: the demo's compute, measured as an anchor in the same run; 0 = no limit; cuda: none)",
    )
    s.add_argument(
        "--steps", type=int, help="training steps to plan for (default 1000 on cpu, 25000 on cuda)"
    )
    s.add_argument("--name", help="run name (default plan-<dataset folder>)")
    s.add_argument(
        "--verify",
        action="store_true",
        help="train two steps at the plan and report measured peak vs predicted",
    )
    s.add_argument(
        "--json", type=Path, help="also write the plan, its predictions and --verify's result here"
    )
    s.add_argument(
        "--refresh", action="store_true", help="read the dataset again instead of the cached fingerprint"
    )
    s.set_defaults(func=_plan)
