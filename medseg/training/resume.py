"""Continuing a run from ``checkpoints/last.pt``: which config changes are allowed, and restoring its state.

Rank 0 alone reads the checkpoint (:func:`read_resume_state`); the other ranks receive it over the
session's channel, and every rank restores it into its own model and optimizer (:func:`restore`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medseg.checkpoint import load_checkpoint, set_rng_state
from medseg.config import Config, config_from_dict, diff_configs
from medseg.errors import ConfigError, RunError
from medseg.training.history import History
from medseg.training.run import Run, RunPaths, run_log
from medseg.training.runlog import read_metrics

# Keys that may change when a run is resumed; anything else must match the saved config.
RESUMABLE_CHANGES = {"train.epochs", "train.device", "train.threads", "data.num_workers", "dist.timeout_s"}


def check_resume(cfg: Config, state: dict[str, Any], last: Path) -> None:
    saved = config_from_dict(state["config"])
    changed = sorted(set(diff_configs(saved, cfg)) - RESUMABLE_CHANGES)
    if changed:
        raise ConfigError(
            f"{last}: cannot resume with a different config; changed keys: {', '.join(changed)} "
            f"(only {', '.join(sorted(RESUMABLE_CHANGES))} may change)"
        )
    if state["epoch"] >= cfg.train.epochs:
        raise RunError(
            f"{last}: the run already finished {state['epoch']} epochs; raise train.epochs to train on"
        )


def read_resume_state(cfg: Config, paths: RunPaths, resume: bool) -> dict[str, Any] | None:
    """The checkpoint to continue from with ``resume``; None for a new run, which must not clobber one."""
    if resume:
        if not paths.last.is_file():
            raise RunError(
                f"{paths.run_dir}: nothing to resume (no checkpoints/last.pt); train without --resume first"
            )
        state = load_checkpoint(paths.last)
        check_resume(cfg, state, paths.last)
        return state
    if paths.last.exists():
        raise RunError(
            f"{paths.run_dir}: already holds a run; pass --resume to continue it, or name=<new name> to start another"
        )
    return None


def restore(run: Run, state: dict[str, Any] | None) -> History:
    """Load ``state`` into the run's model, optimizer, scheduler and random generators; the history so far.

    Epochs recorded after the checkpoint are dropped (they will be trained again). Without a state the
    run starts at epoch 1 with no history.
    """
    records = read_metrics(run.paths.metrics)
    if state is None:
        return History()
    run.model.load_state_dict(state["model"])
    run.base_optimizer.load_state_dict(state["optimizer"])
    if run.scheduler is not None and state.get("scheduler"):
        run.scheduler.load_state_dict(state["scheduler"])
        # a resumed run may have been given more epochs: the schedule's length is this run's
        if hasattr(run.scheduler, "T_max"):
            run.scheduler.T_max = run.cfg.train.epochs
        if hasattr(run.scheduler, "total_iters"):
            run.scheduler.total_iters = run.cfg.train.epochs
    set_rng_state(state["rng"])
    history = History(
        records=[r for r in records if r["epoch"] <= state["epoch"]],
        start=state["epoch"] + 1,
        best_epoch=state.get("best_epoch"),
    )
    history.best_record = next((r for r in history.records if r["epoch"] == history.best_epoch), None)
    if history.best_record is None and state.get("best_metric") is not None:
        history.best_record = {run.task.key_metric: state["best_metric"]}
    run_log.info("resuming %s at epoch %d of %d", run.cfg.run_dir, history.start, run.cfg.train.epochs)
    return history
