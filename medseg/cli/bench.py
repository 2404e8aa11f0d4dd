"""``medseg bench``: the sites, real-sites, memory and inference benchmarks, each ending in a JSON report."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from medseg.errors import ConfigError


def _report(
    result: dict[str, Any],
    args: argparse.Namespace,
    write_report: Callable[[dict[str, Any], Path, Path | None], None],
    format_table: Callable[[dict[str, Any]], str],
    check_targets: Callable[[dict[str, Any]], list[tuple[str, bool]]],
) -> None:
    """Every benchmark's ending: JSON (and markdown section) written, table and target checks printed."""
    write_report(result, args.json, args.markdown)
    print(format_table(result))
    for name, ok in check_targets(result):
        print(f"{'met   ' if ok else 'MISSED'} {name}")
    print(f"wrote {args.json}" + (f" and {args.markdown}" if args.markdown else ""))


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what}: {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: {path} is not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} holds no benchmark result (not a JSON object)")
    return data


def _need_cuda_if_asked(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu")


def _sites(args: argparse.Namespace) -> None:
    from medseg.bench.sites import bench_sites, check_targets, format_table, write_report

    result = bench_sites(
        args.workdir,
        quick=args.quick,
        seeds=args.seeds,
        epochs=args.epochs,
        scenarios=args.scenarios.split(",") if args.scenarios else None,
        configs=args.configs.split(",") if args.configs else None,
        reuse=_read_json(args.reuse, "--reuse") if args.reuse else None,
        secure=args.secure,
    )
    _report(result, args, write_report, format_table, check_targets)


def _real_sites(args: argparse.Namespace) -> None:
    from medseg.bench.real_sites import bench_real_sites
    from medseg.bench.real_sites_report import check_targets, format_table, write_report
    from medseg.bench.real_sites_tune import tuned_points

    result = bench_real_sites(
        args.workdir,
        args.data,
        seeds=args.seeds,
        configs=args.configs.split(",") if args.configs else None,
        gpu_step_s=args.gpu_step_s,
        tuned=tuned_points(_read_json(args.tuned, "--tuned")) if args.tuned else None,
    )
    _report(result, args, write_report, format_table, check_targets)


def _real_sites_tune(args: argparse.Namespace) -> None:
    from medseg.bench import real_sites_tune as tune

    earlier = _read_json(args.add_to, "--add-to") if args.add_to else None
    if earlier is not None:
        tune.check_same_rule(earlier, args.epochs)  # before the hours of training, not after
    result = tune.tune_real_sites(
        args.workdir,
        args.data,
        configs=args.configs.split(",") if args.configs else None,
        epochs=args.epochs,
        gpu_step_s=args.gpu_step_s,
    )
    if earlier is not None:
        result = tune.add_to(earlier, result)
    _report(result, args, tune.write_report, tune.format_table, tune.check_targets)


def _memory(args: argparse.Namespace) -> None:
    from medseg.bench.memory import bench_memory, check_targets, format_table, write_report

    _need_cuda_if_asked(args.device)
    result = bench_memory(
        quick=args.quick,
        device=args.device,
        nets=tuple(args.nets),
        budget_gb=args.budget_gb,
        verify=args.verify,
        variants=tuple(args.variants) if args.variants else None,
        steps=args.steps,
    )
    _report(result, args, write_report, format_table, check_targets)


def _parse_sizes(texts: list[str]) -> list[tuple[int, ...]]:
    """``--sizes``: each IxJxK of positive whole numbers as a tuple."""
    sizes = []
    for text in texts:
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(
                f"--sizes {text}: give sizes as IxJxK with positive whole numbers, e.g. 512x512x300"
            )
        sizes.append(tuple(int(n) for n in parts))
    return sizes


def _reused_runs(log: Path) -> dict:
    """``--reuse-log``: the finished runs an interrupted invocation printed to ``log``."""
    from medseg.bench.infer import runs_from_log

    if not log.is_file():
        raise ConfigError(f"--reuse-log {log}: no such file; give the log an earlier run printed to")
    runs = runs_from_log(log.read_text())
    if not runs:
        raise ConfigError(
            f"--reuse-log {log}: holds no finished runs (lines 'IxJxK classes variant {{json}}')"
        )
    return runs


def _infer(args: argparse.Namespace) -> None:
    from medseg.bench.infer import bench_infer, check_targets, format_table, write_report

    _need_cuda_if_asked(args.device)
    kwargs: dict[str, Any] = {}
    if args.sizes:
        kwargs["sizes"] = _parse_sizes(args.sizes)
    if args.classes:
        kwargs["classes"] = tuple(args.classes)
    if args.variants:
        kwargs["variants"] = tuple(args.variants)
    if args.old_limit_gb is not None:
        kwargs["old_limit_bytes"] = int(args.old_limit_gb * 2**30)
    if args.reuse_log is not None:
        kwargs["reuse"] = _reused_runs(args.reuse_log)
    result = bench_infer(
        args.workdir, quick=args.quick, device=args.device, rounds=args.rounds, partial=args.json, **kwargs
    )
    _report(result, args, write_report, format_table, check_targets)


def _add_sites(bench: argparse._SubParsersAction) -> None:
    s = bench.add_parser(
        "sites", help="sync modes between emulated hospitals (network namespaces, shaped WAN), root only"
    )
    s.add_argument("--quick", action="store_true", help="20 Mbit/s and no-WAN scenarios, 4 configs, 1 seed")
    s.add_argument("--json", type=Path, required=True, help="write the results here")
    s.add_argument("--markdown", type=Path, help="update this markdown file's sites section")
    s.add_argument("--seeds", type=int, help="seeds per config (default 3, --quick 1)")
    s.add_argument("--epochs", type=int, help="epochs per run (default 8, --quick 4)")
    from medseg.bench.sites_configs import CONFIGS, SCENARIOS, SECURE_TWIN

    plain = ",".join(n for n in SCENARIOS if n not in SECURE_TWIN)
    s.add_argument("--scenarios", help=f"comma-separated subset of {plain}")
    s.add_argument(
        "--secure",
        action="store_true",
        help="also run wan20 over the site link (WireGuard), right after it in clear, and compare the two",
    )
    s.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIGS)}")
    s.add_argument(
        "--workdir", type=Path, default=Path("runs/bench-sites"), help="data and runs of the benchmark"
    )
    s.add_argument(
        "--reuse",
        type=Path,
        help="an earlier --json of the same seeds and epochs: its scenario/config results are kept, not re-run",
    )
    s.set_defaults(func=_sites)


def _add_real_sites(bench: argparse._SubParsersAction) -> None:
    from medseg.bench.real_sites import CONFIGS, GPU_STEP_S

    s = bench.add_parser(
        "real-sites",
        help="real MR across three unlike sites, links dilated to a GPU's cost, gssp against the peers; root only",
    )
    s.add_argument("--seeds", type=int, default=3, help="seeds per config (default 3)")
    s.add_argument(
        "--tuned",
        type=Path,
        help="a `bench real-sites-tune` JSON: each config trains with its chosen lr and round lever",
    )
    _add_real_sites_common(s, CONFIGS, GPU_STEP_S, "runs/bench-real-sites")
    s.set_defaults(func=_real_sites)


def _add_real_sites_common(
    s: argparse.ArgumentParser, configs: dict, gpu_step_s: float, workdir: str
) -> None:
    """The options ``real-sites`` and ``real-sites-tune`` share: data, reports, configs, dilation, workdir."""
    s.add_argument(
        "--data", type=Path, required=True, help="a Decathlon-layout dataset (e.g. Task04_Hippocampus)"
    )
    s.add_argument("--json", type=Path, required=True, help="write the results here")
    s.add_argument("--markdown", type=Path, help="update this markdown file's section")
    s.add_argument("--configs", help=f"comma-separated subset of {','.join(configs)}")
    s.add_argument(
        "--gpu-step-s",
        type=float,
        default=gpu_step_s,
        help=f"a GPU site's seconds per network step of the planned model (default {gpu_step_s}, measured on an "
        "H200 by scripts/gpu_check.sh): sets the dilation",
    )
    s.add_argument(
        "--workdir", type=Path, default=Path(workdir), help="site folders and runs of the benchmark"
    )


def _add_real_sites_tune(bench: argparse._SubParsersAction) -> None:
    from medseg.bench.real_sites import CONFIGS, GPU_STEP_S
    from medseg.bench.real_sites_tune import TUNE_EPOCHS

    s = bench.add_parser(
        "real-sites-tune",
        help="each real-sites config's lr and round lever chosen by one rule on validation; root only",
    )
    s.add_argument(
        "--epochs", type=int, default=TUNE_EPOCHS, help=f"epochs per grid point (default {TUNE_EPOCHS})"
    )
    s.add_argument(
        "--add-to",
        type=Path,
        help="an earlier real-sites-tune JSON of the same rule: its other configs are kept beside this run's",
    )
    _add_real_sites_common(s, CONFIGS, GPU_STEP_S, "runs/bench-real-sites-tune")
    s.set_defaults(func=_real_sites_tune)


def _add_memory(bench: argparse._SubParsersAction) -> None:
    s = bench.add_parser(
        "memory", help="fused kernels vs baseline, checkpointing and torch.compile: memory and time"
    )
    s.add_argument(
        "--quick", action="store_true", help="64^3 patches, no torch.compile variant (a few minutes)"
    )
    s.add_argument("--json", type=Path, default=Path("bench-memory.json"), help="write results here")
    s.add_argument("--markdown", type=Path, help="update this markdown file's memory section")
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument(
        "--nets",
        nargs="+",
        default=["unet", "segresnet", "dynunet", "unet-14cls"],
        choices=["unet", "segresnet", "dynunet", "unet-14cls"],
        help="cases; unet-14cls: UNet at the default width with 14 classes",
    )
    s.add_argument(
        "--variants",
        nargs="+",
        choices=["baseline", "fused", "checkpoint", "compile"],
        help="default: all four (--quick: all but compile)",
    )
    s.add_argument(
        "--budget-gb",
        type=float,
        help="memory budget for the largest patch (default 1 GiB with --quick, else 8)",
    )
    s.add_argument(
        "--verify", action="store_true", help="measure each variant at its predicted largest patch"
    )
    s.add_argument("--steps", type=int, default=5, help="timed steps per variant (median reported)")
    s.set_defaults(func=_memory)


def _add_infer(bench: argparse._SubParsersAction) -> None:
    s = bench.add_parser(
        "infer", help="predict's memory and time vs the previous path, synthetic CTs up to 512x512x1000"
    )
    s.add_argument("--quick", action="store_true", help="small volumes, one round (a minute or two)")
    s.add_argument("--json", type=Path, required=True, help="write the results here")
    s.add_argument("--markdown", type=Path, help="update this markdown file's infer section")
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument("--rounds", type=int, default=2, help="timed rounds of old and new per case (default 2)")
    s.add_argument("--sizes", nargs="+", metavar="IxJxK", help="input sizes (default: all three CT sizes)")
    s.add_argument("--classes", type=int, nargs="+", help="class counts (default: 3 14)")
    s.add_argument(
        "--variants",
        nargs="+",
        choices=["old", "new", "new-stream", "new-fp16"],
        help="variants to run (default: all; old only where it fits, new-fp16 only at 256x256x128 and --quick)",
    )
    s.add_argument(
        "--old-limit-gb",
        type=float,
        help="run the previous path only where its predicted peak is below this (default 14)",
    )
    s.add_argument(
        "--reuse-log",
        type=Path,
        help="take the runs an interrupted invocation printed to this log (its label maps must be in --workdir)",
    )
    s.add_argument(
        "--workdir",
        type=Path,
        default=Path("runs/bench-infer"),
        help="bundles and label maps of the benchmark",
    )
    s.set_defaults(func=_infer)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``medseg bench`` and its benchmarks sites, memory and infer."""
    bench = subparsers.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True
    )
    _add_sites(bench)
    _add_real_sites(bench)
    _add_real_sites_tune(bench)
    _add_memory(bench)
    _add_infer(bench)
