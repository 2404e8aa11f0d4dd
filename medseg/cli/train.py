"""``medseg train``: one process, or N ranks under horovodrun (``--np``) started by the launcher."""

from __future__ import annotations

import argparse
from pathlib import Path


def _train(args: argparse.Namespace) -> None:
    from medseg.config import load_config
    from medseg.distributed.launch.launcher import end_rank, is_worker, launch, skip_unused_imports

    if is_worker():
        skip_unused_imports()  # before anything imports MONAI
    cfg = load_config(args.config, args.overrides)
    if args.np is not None and not is_worker():
        launch(
            cfg,
            args.config,
            args.overrides,
            args.np,
            args.hosts,
            args.resume,
            max_restarts=args.max_restarts,
            min_sites=args.min_sites,
        )
        _print_run(cfg.run_dir)
        return
    from medseg.distributed.testbed.emulate import install_from_env
    from medseg.training.loop import train  # not before: the launcher itself never trains

    install_from_env()  # test-only emulation (a straggler, slow phases): the one seam, a no-op unless asked
    result = train(cfg, resume=args.resume, progress=not args.no_progress)
    if is_worker():
        end_rank()  # the launcher reports for the whole job
    best = (
        f"{result.best_metric:.4f} at epoch {result.best_epoch}" if result.best_metric is not None else "n/a"
    )
    print(
        f"run {result.run_dir}: {result.epochs} epochs, best {result.key_metric} {best}; bundle in {result.run_dir / 'bundle'}"
    )


def _print_run(run_dir: Path) -> None:
    """The launcher's summary of a multi-rank run, read from the run's metrics.jsonl."""
    from medseg.training.runlog import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    if records:
        last = records[-1]
        shown = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if isinstance(v, float))
        print(f"run {run_dir}: {last['epoch']} epochs; last epoch {shown}; bundle in {run_dir / 'bundle'}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``medseg train``."""
    s = subparsers.add_parser("train", help="train a model from a YAML config")
    s.add_argument("--config", type=Path, required=True)
    s.add_argument(
        "--resume", action="store_true", help="continue the run named by the config from its last checkpoint"
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument(
        "--np", type=int, help="train on N ranks under horovodrun (needs dist.sync other than none)"
    )
    s.add_argument("--hosts", help="HOST:SLOTS,... for --np across servers (default localhost:N)")
    s.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --np: when a site's ranks die or its link is cut, restart from the last checkpoint "
        "without that site, up to N times (default 0: stop)",
    )
    s.add_argument(
        "--min-sites", type=int, default=1, help="with --max-restarts: stop (exit 2) below this many sites"
    )
    s.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.epochs=5")
    s.set_defaults(func=_train)
