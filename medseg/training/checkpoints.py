"""What a run keeps of itself: each epoch's checkpoint (``last.pt``, ``best.pt``) and, at the end, the
bundle made from the best epoch."""

from __future__ import annotations

from typing import Any

from medseg.bundle.export import export_bundle
from medseg.checkpoint import load_checkpoint, rng_state, save_checkpoint
from medseg.training.history import History
from medseg.training.run import Run, RunPaths


def checkpoint_payload(
    run: Run,
    history: History,
    epoch: int,
    sync_marker: dict[str, int] | None,
    site_local: dict[str, Any] | None,
) -> dict[str, Any]:
    """Everything ``--resume`` needs to continue exactly after ``epoch``, and the bundle to be made.

    ``sync_marker`` names the synchronisation state each rank saved locally (``dist``); ``site_local``
    holds each site's own normalisation tensors, for per-site evaluation of the bundle.
    """
    payload = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
        "epoch": epoch,
        "best_metric": history.best_metric(run.task.key_metric),
        "best_epoch": history.best_epoch,
        "rng": rng_state(),
        "config": run.cfg.to_dict(),
        "labels": {str(k): v for k, v in run.labels.items()},
    }
    if sync_marker is not None:
        payload["dist"] = sync_marker
    if site_local:
        payload["site_local"] = site_local
    return payload


def save_checkpoints(payload: dict[str, Any], paths: RunPaths, best: bool) -> None:
    """``last.pt`` every epoch; ``best.pt`` too when the epoch is the best so far."""
    save_checkpoint(payload, paths.last)
    if best:
        save_checkpoint(payload, paths.best)


def export_best(run: Run, history: History) -> None:
    """The bundle of the best epoch's checkpoint, with that epoch's validation metrics."""
    best_state = load_checkpoint(run.paths.best)
    exported = next((r for r in history.records if r["epoch"] == best_state["epoch"]), {})
    export_bundle(run.cfg, best_state, metrics={k: v for k, v in exported.items() if k.startswith("val_")})
