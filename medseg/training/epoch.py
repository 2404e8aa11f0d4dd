"""One epoch's work on a rank: the training steps, then validation and the pooling of site metrics."""

from __future__ import annotations

import time
from typing import Any

import torch
from tqdm import tqdm

from medseg.training.run import Run


def _plain(x: torch.Tensor) -> torch.Tensor:
    """Drop MetaTensor bookkeeping for the network's forward and backward (it costs time, not accuracy)."""
    return x.as_tensor() if hasattr(x, "as_tensor") else x


def _step(run: Run, batch: dict[str, Any], epoch: int, step: int) -> float:
    """One optimizer step on ``batch`` (its gradients synchronised by the session's optimizer); the loss."""
    session, device, amp = run.session, run.device, run.amp
    inputs, targets = _plain(batch["image"].to(device)), _plain(run.task.targets(batch, device))
    run.optimizer.zero_grad(set_to_none=True)
    with session.compute():
        with torch.autocast(device.type, dtype=amp.dtype, enabled=amp.enabled):
            loss = run.task.step_loss(run.model, inputs, targets)
        amp.scaler.scale(loss).backward()
    if amp.scaler.is_enabled():
        amp.scaler.step(run.optimizer)
        amp.scaler.update()
    else:
        run.optimizer.step()
    session.after_step(epoch, step, int(inputs.shape[0]))
    return loss.item()


def train_steps(run: Run, epoch: int) -> dict[str, Any]:
    """Train one pass over this rank's share of the cases; the epoch's record so far.

    The record holds the mean training loss, the learning rate after the scheduler's step and the
    epoch's wall seconds.
    """
    cfg = run.cfg
    run.model.train()
    tic, losses = time.perf_counter(), []
    bar = tqdm(
        run.data.train_loader,
        desc=f"{cfg.name} epoch {epoch}/{cfg.train.epochs}",
        leave=False,
        disable=not run.progress,
    )
    for step, batch in enumerate(bar):
        losses.append(_step(run, batch, epoch, step))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    if run.scheduler is not None:
        run.scheduler.step()
    return {
        "epoch": epoch,
        "train_loss": sum(losses) / len(losses),
        "lr": run.base_optimizer.param_groups[0]["lr"],
        "epoch_s": round(time.perf_counter() - tic, 3),
    }


def score(run: Run, epoch: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's validation scores (empty when nothing was scored here) and what it sends for its
    site in the epoch-end message (None without sites or when validation is not due).

    Scores are taken every ``train.val_interval`` epochs and at the last epoch, by the ranks that
    validate (with sites, each site's leader on its own held-out cases).
    """
    cfg, session, data = run.cfg, run.session, run.data
    due = epoch % cfg.train.val_interval == 0 or epoch == cfg.train.epochs
    scores: dict[str, Any] = {}
    if session.validates and data.val_loader is not None and due:
        session.phase("validate")
        run.model.eval()
        scores = run.task.validate(run.model, data.val_loader, run.device)
    session.phase("wait")
    site_scores = {**scores, "val_cases": len(data.val_items)} if cfg.sites and due else None
    return scores, site_scores


def pooled(scores: dict[str, Any], per_site: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """The epoch's scores: with sites, every site's pooled (each metric's mean over sites weighted by
    their validation cases, :func:`~medseg.distributed.site_data.pool_metrics`) with each site's
    own under ``sites``, the same on every rank; else this rank's own."""
    if per_site is None:
        return scores
    from medseg.distributed.site_data import pool_metrics

    return {**pool_metrics(per_site), "sites": per_site}


def validate(run: Run, epoch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The epoch's job numbers and its scores (:func:`score`, then :func:`pooled`).

    With sites only the scores travel, to every rank, with every rank's epoch numbers
    (:meth:`~medseg.distributed.session.HorovodSession.finish_epoch`).
    """
    scores, site_scores = score(run, epoch)
    numbers, per_site = run.session.finish_epoch(site_scores)
    return numbers, pooled(scores, per_site)
