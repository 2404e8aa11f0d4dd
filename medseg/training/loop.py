"""The training loop: one function for every task, network and synchronisation mode.

A run lives in ``<runs_dir>/<name>/``: ``config.yaml`` (resolved), ``checkpoints/last.pt`` and
``best.pt``, ``metrics.jsonl``, ``learning_curve.png``, ``train.log`` and, at the end, ``bundle/``.
The loop asks :mod:`medseg.distributed` for its optimizer and does not know how it synchronises.
This module holds the epochs; building the run (:mod:`~medseg.training.build`), resuming
(:mod:`~medseg.training.resume`), an epoch's steps and validation (:mod:`~medseg.training.epoch`),
the best epoch and early stopping (:mod:`~medseg.training.history`) and what is saved
(:mod:`~medseg.training.checkpoints`) live beside it.
"""

from __future__ import annotations

import logging
import shutil
from functools import partial
from pathlib import Path
from typing import Any

from medseg.config import Config, save_config
from medseg.datasets.checks import prepare_output_dir
from medseg.distributed import LocalSession, open_session
from medseg.distributed.comm.checks import UpdateRefused
from medseg.errors import MedsegError
from medseg.training.build import build_run
from medseg.training.checkpoints import checkpoint_payload, export_best, save_checkpoints
from medseg.training.data import seed_epoch
from medseg.training.epoch import train_steps
from medseg.training.epoch_end import EpochEnd, defers
from medseg.training.history import History, reached_stop_at, stop_due
from medseg.training.resume import read_resume_state, restore
from medseg.training.run import Run, RunPaths, TrainResult
from medseg.training.runlog import plot_learning_curve, write_metrics

log = logging.getLogger(__name__)


def _attach_log_file(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("medseg").addHandler(handler)
    return handler


def train(
    cfg: Config,
    resume: bool = False,
    progress: bool = True,
    until_epoch: int | None = None,
) -> TrainResult:
    """Train ``cfg`` from scratch, or continue the run in ``cfg.run_dir`` when ``resume`` is true.

    ``until_epoch`` (else ``train.until_epoch``) stops after that epoch as an interruption would
    (checkpoint written, no bundle), so a run can be trained in slices; ``resume`` picks it up.
    Inside a rank started by ``medseg train --np N`` the same function runs on every rank; rank 0 alone writes the run
    folder (checkpoints, metrics, plots, bundle). Test-only emulation (a slow rank or phase) enters through
    :mod:`medseg.distributed.emulation`, never through this function.
    """
    paths = RunPaths.of(cfg)
    session = open_session(cfg)
    handler, created = None, False
    try:
        # Rank 0 alone reads and writes the run folder; the other ranks (possibly in other
        # hospitals, without that folder) receive its resume state over the channel.
        state: dict[str, Any] | None = None
        if session.is_chief:
            state = read_resume_state(cfg, paths, resume)
            created = not paths.run_dir.exists()
            prepare_output_dir(
                paths.run_dir, what="run folder"
            )  # a clear error when a file stands in the way
            handler = _attach_log_file(paths.run_dir)
        state = session.share_state(state)
        stop = until_epoch or cfg.train.until_epoch or cfg.train.epochs
        return _train(cfg, session, state, paths, progress, stop)
    except MedsegError as exc:
        # the launcher shows it instead of "rank R failed"; a refused update names the rank that sent it
        refused = exc.rank if isinstance(exc, UpdateRefused) else None
        session.report({"ev": "error", "message": str(exc), "refused_rank": refused})
        raise
    finally:
        if handler is not None:
            logging.getLogger("medseg").removeHandler(handler)
            handler.close()
        session.close()
        if created and session.is_chief and not paths.last.exists():
            # stopped before its first checkpoint (bad data or config): leave no half-made run folder
            shutil.rmtree(paths.run_dir, ignore_errors=True)


def _train(
    cfg: Config,
    session: LocalSession,
    state: dict[str, Any] | None,
    paths: RunPaths,
    progress: bool,
    stop: int,
) -> TrainResult:
    """Build the run, restore ``state`` into it, train its epochs up to ``stop``, then finish it."""
    run = build_run(cfg, session, paths, progress)
    history = restore(run, state)
    run.optimizer = session.wrap_optimizer(run.base_optimizer, run.model)
    if state is not None:
        session.load_sync_state(run.optimizer, cfg.run_dir, state.get("dist"))
    if session.is_chief:
        save_config(cfg, cfg.run_dir / "config.yaml")
    last = _run_epochs(run, history, stop)
    return _finish(run, history, stop, last)


def _run_epochs(run: Run, history: History, stop: int) -> int:
    """Train from ``history.start`` up to epoch ``stop`` (or until train.stop_at); the last epoch trained.

    An epoch's end message is taken while the next epoch trains where no decision hangs on it
    (:mod:`~medseg.training.epoch_end`): it is closed once that epoch's steps are done.
    """
    cfg, session, t = run.cfg, run.session, run.cfg.train
    # the key metric reached train.stop_at: every rank's own decision from the same pooled scores
    # where every rank holds them (agreed), else the chief's, shared at the next epoch's start;
    # before the first epoch every rank holds the same one (no stop), but without sites rank 0's
    # barrier also starts the epoch clocks together (HorovodSession.start_epoch)
    reached, agreed = False, session.scores_everywhere and bool(cfg.sites)
    last = min(stop, t.epochs)
    arriving: EpochEnd | None = None  # the previous epoch's end, its message still on the way
    for epoch in range(history.start, last + 1):
        seed_epoch(run.data, t.seed, epoch, session.rank)
        if session.start_epoch(reached, agreed) and t.stop_at:  # the same decision on every rank
            last = epoch - 1
            break
        try:
            record = train_steps(run, epoch)
        except Exception:
            _keep_finished_epoch(run, history, arriving)
            raise
        if arriving is not None:  # before end_epoch: its world-group messages come after this one
            _close_epoch(run, history, arriving)
            arriving = None
        record.update(session.end_epoch(run.optimizer))
        sync_marker = session.save_sync_state(run.optimizer, cfg.run_dir, epoch)  # each rank's residuals
        site_local = session.gather_site_local(run.optimizer)  # local_norm: each site's tensors, on rank 0
        chief_saves = (
            partial(checkpoint_payload, run, history, epoch, sync_marker, site_local)
            if session.is_chief
            else None
        )
        later = defers(run, epoch, last)
        ending = EpochEnd(run, record, chief_saves, later=later)
        agreed = session.scores_everywhere
        if later:
            arriving = ending  # no stop can follow this epoch: reached stays False
        else:
            reached = _close_epoch(run, history, ending)
    return last


# how long a failing epoch waits for the previous epoch's message before giving that epoch up
FINISHED_EPOCH_WAIT_S = 30.0


def _keep_finished_epoch(run: Run, history: History, arriving: EpochEnd | None) -> None:
    """An epoch failed while the previous one's message was still being taken: write that finished
    epoch (record and checkpoint, made before the failing epoch began) if its message arrives
    within :data:`FINISHED_EPOCH_WAIT_S`, so that a resume or restart starts after it. A message
    that fails or does not come (a peer is gone) loses only that epoch; the failure is raised."""
    if arriving is not None and arriving.arrives_within(FINISHED_EPOCH_WAIT_S):
        _close_epoch(run, history, arriving)


def _close_epoch(run: Run, history: History, ending: EpochEnd) -> bool:
    """Take ``ending``'s message; the chief writes the epoch (:func:`_save_epoch`). Returns whether
    the key metric reached ``train.stop_at`` (on every rank where every rank holds the scores)."""
    numbers, scores, arrived_wall = ending.arrived()
    session, record = run.session, ending.record
    if not session.is_chief:
        metric = scores.get(run.task.key_metric)
        return session.scores_everywhere and stop_due(run.cfg.train, metric, record["epoch"])
    record.update(numbers)
    record.update(scores)
    if scores:
        record["val_s"] = round(ending.val_s, 3)  # not training: left out of training-time curves
    record["time"] = round(arrived_wall, 3)  # wall clock when the scores were known: time-to-accuracy curves
    record["train_start"] = round(run.train_start, 3)
    assert ending.payload is not None
    return _save_epoch(run, history, record, ending.payload)


def _save_epoch(run: Run, history: History, record: dict[str, Any], payload: dict[str, Any]) -> bool:
    """The chief's end of an epoch: checkpoints (``payload``, with the best epoch so far filled in),
    metrics.jsonl, the plot and the log line.

    Returns whether the key metric reached ``train.stop_at`` (early stopping).
    """
    cfg, task, epoch = run.cfg, run.task, record["epoch"]
    run.session.phase("save")
    metric = record.get(task.key_metric)
    is_best = history.note_best(epoch, record, task)
    payload.update(best_metric=history.best_metric(task.key_metric), best_epoch=history.best_epoch)
    history.records.append(record)
    # metrics.jsonl before last.pt: a chief killed between the two leaves a record newer than the
    # checkpoint, which a resume drops and trains again; the other order would lose the epoch's record
    write_metrics(run.paths.metrics, history.records)
    save_checkpoints(payload, run.paths, best=is_best or run.data.val_loader is None)
    reached = reached_stop_at(cfg.train, task.key_metric, metric, epoch)
    plot_learning_curve(history.records, task.key_metric, cfg.run_dir / "learning_curve.png")
    shown = " ".join(f"{k}={v:.4f}" for k, v in record.items() if isinstance(v, float) and k != "epoch_s")
    log.info("epoch %d/%d %s (%.1fs)", epoch, cfg.train.epochs, shown, record["epoch_s"])
    return reached


def _finish(run: Run, history: History, stop: int, last: int) -> TrainResult:
    """The run's result; the bundle is exported unless training stopped at ``stop`` to be resumed."""
    cfg, key = run.cfg, run.task.key_metric
    if not run.session.is_chief:
        return TrainResult(cfg.run_dir, last, None, None, key, {})
    best_metric = history.best_metric(key)
    if stop < cfg.train.epochs and last == stop:
        log.info("stopped after epoch %d of %d; continue with --resume", stop, cfg.train.epochs)
        return TrainResult(cfg.run_dir, stop, best_metric, history.best_epoch, key, history.records[-1])
    export_best(run, history)
    final = history.records[-1] if history.records else {}
    return TrainResult(cfg.run_dir, last, best_metric, history.best_epoch, key, final)
