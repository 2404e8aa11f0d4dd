"""The training loop: one function for every task, network and (later) synchronisation mode.

A run lives in ``<runs_dir>/<name>/``: ``config.yaml`` (resolved), ``checkpoints/last.pt`` and
``best.pt``, ``metrics.jsonl``, ``learning_curve.png``, ``train.log`` and, at the end, ``bundle/``.
The loop asks :mod:`medseg.distributed` for its optimizer and does not know how it synchronises.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from medseg.bundle.export import export_bundle
from medseg.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from medseg.config import Config, config_from_dict, diff_configs, save_config
from medseg.datasets.checks import prepare_output_dir
from medseg.distributed import LocalSession, open_session
from medseg.errors import ConfigError, MedsegError, RunError
from medseg.models import build_network, network_def
from medseg.training.data import make_train_data, read_dataset, seed_epoch
from medseg.training.runlog import plot_learning_curve, read_metrics, write_metrics
from medseg.training.tasks import improves, make_task

log = logging.getLogger(__name__)

# Keys that may change when a run is resumed; anything else must match the saved config.
RESUMABLE_CHANGES = {"train.epochs", "train.device", "train.threads", "data.num_workers", "dist.timeout_s"}


@dataclass
class TrainResult:
    run_dir: Path
    epochs: int
    best_metric: float | None
    best_epoch: int | None
    key_metric: str
    last_record: dict[str, Any]


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: cuda was asked for but torch sees no CUDA device; use auto or cpu")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def _optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=t.lr, momentum=0.9, weight_decay=t.weight_decay, nesterov=True
        )
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    return cls(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)


def _attach_log_file(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("medseg").addHandler(handler)
    return handler


def _plain(x: torch.Tensor) -> torch.Tensor:
    """Drop MetaTensor bookkeeping for the network's forward and backward (it costs time, not accuracy)."""
    return x.as_tensor() if hasattr(x, "as_tensor") else x


def _probe_batch(cfg: Config, num_classes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A random batch shaped like a training batch, for timing a rank's forward and backward pass."""
    b, patch = cfg.train.batch_size * max(cfg.transforms.num_samples, 1), list(cfg.transforms.patch)
    g = torch.Generator().manual_seed(0)
    image = torch.rand([b, 1, *patch], generator=g)
    if cfg.task == "segmentation":
        target = torch.randint(0, num_classes, [b, 1, *patch], generator=g)
    else:
        b = cfg.train.batch_size
        image, target = image[:b], torch.randint(0, num_classes, [b], generator=g)
    return {"image": image.to(device), "target": target.to(device)}


def _check_resume(cfg: Config, state: dict[str, Any], last: Path) -> None:
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


def train(
    cfg: Config,
    resume: bool = False,
    progress: bool = True,
    until_epoch: int | None = None,
) -> TrainResult:
    """Train ``cfg`` from scratch, or continue the run in ``cfg.run_dir`` when ``resume`` is true.

    ``until_epoch`` stops after that epoch as an interruption would (checkpoint written, no bundle),
    so a run can be trained in slices; ``resume`` picks it up. Inside a rank started by
    ``medseg train --np N`` the same function runs on every rank; rank 0 alone writes the run
    folder (checkpoints, metrics, plots, bundle). Test-only emulation (a slow rank or phase) enters through
    :mod:`medseg.distributed.emulation`, never through this function.
    """
    run_dir, ckpt_dir = cfg.run_dir, cfg.run_dir / "checkpoints"
    last_path, best_path, metrics_path = ckpt_dir / "last.pt", ckpt_dir / "best.pt", run_dir / "metrics.jsonl"
    session = open_session(cfg)
    handler, created = None, False
    try:
        # Rank 0 alone reads and writes the run folder; the other ranks (possibly in other
        # hospitals, without that folder) receive its resume state over the channel.
        state: dict[str, Any] | None = None
        if session.is_chief:
            if resume:
                if not last_path.is_file():
                    raise RunError(
                        f"{run_dir}: nothing to resume (no checkpoints/last.pt); train without --resume first"
                    )
                state = load_checkpoint(last_path)
                _check_resume(cfg, state, last_path)
            elif last_path.exists():
                raise RunError(
                    f"{run_dir}: already holds a run; pass --resume to continue it, or name=<new name> to start another"
                )
            created = not run_dir.exists()
            prepare_output_dir(run_dir, what="run folder")  # a clear error when a file stands in the way
            handler = _attach_log_file(run_dir)
        state = session.share_state(state)
        return _train(
            cfg, session, state, progress, until_epoch or cfg.train.epochs, last_path, best_path, metrics_path
        )
    except MedsegError as exc:
        session.report(
            {"ev": "error", "message": str(exc)}
        )  # the launcher shows it instead of "rank R failed"
        raise
    finally:
        if handler is not None:
            logging.getLogger("medseg").removeHandler(handler)
            handler.close()
        session.close()
        if created and session.is_chief and not last_path.exists():
            # stopped before its first checkpoint (bad data or config): leave no half-made run folder
            shutil.rmtree(run_dir, ignore_errors=True)


def _train(
    cfg: Config,
    session: LocalSession,
    state: dict | None,
    progress: bool,
    stop: int,
    last_path: Path,
    best_path: Path,
    metrics_path: Path,
) -> TrainResult:
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    device = pick_device(t.device)
    use_amp = t.amp and device.type == "cuda"
    torch.manual_seed(t.seed)  # weight initialisation; each epoch reseeds its own draws
    session.phase("read")  # the dataset's list and headers; "load" below reads and caches the cases
    # with sites: this rank's own site's folder only. With several ranks each checks the files of
    # the cases it loads (make_train_data), not all of them: at a quarter core, 160 cases' checks
    # took a rank 1.9 s of its start. Those checks come after train_start (a rank knows its cases
    # once the groups are formed), so time to accuracy includes them: rank 0's 64-75 cases in the
    # sites benchmark, about 0.4 s at its half core, the same for every config.
    several = session.size > 1
    split = read_dataset(cfg, session.data_dir(cfg), check_cases=not several)
    if cfg.sites:
        from medseg.distributed.site_data import dataset_facts

        # header facts against the other sites' before anything is built or trained
        session.check_sites(dataset_facts(split[0], len(split[1]), len(split[2])))
    labels = split[0].labels
    task = make_task(cfg, labels)
    model = build_network(network_def(cfg, out_channels=len(labels))).to(device)
    if t.memory == "fused":
        from medseg.kernels import optimize_memory
        from medseg.kernels.dispatch import backend_name

        report = optimize_memory(model)
        log.info("train.memory=fused (%s): %s", backend_name(), report.format())
    base_optimizer = _optimizer(cfg, model)
    # Speed is measured on a batch made before timing starts (the shapes of a training batch; the
    # values do not change the cost), so neither loading nor caching is ever timed.
    probe = _probe_batch(cfg, len(labels), device)

    def profile_step() -> int:
        """One forward and backward pass (no update), for measuring this rank's speed."""
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            loss = task.step_loss(model, probe["image"], probe["target"])
        loss.backward()
        model.zero_grad(set_to_none=True)
        return int(probe["image"].shape[0])

    train_start = time.time()  # before profiling: time-to-accuracy counts it, not imports or start-up
    session.prepare(profile_step, model)
    session.phase("load")
    data = make_train_data(cfg, session, split, check_cases=several)  # this rank's own cases, cached once
    session.report(
        {
            "ev": "loaded",
            "cases": len(data.train_items),
            "cache_mb": round(data.cache_mb, 1),
            "site": session.site,
            "data": str(data.info.root),  # the one dataset folder this rank opened
        }
    )
    scheduler = (
        torch.optim.lr_scheduler.CosineAnnealingLR(base_optimizer, T_max=t.epochs)
        if t.scheduler == "cosine"
        else None
    )
    # bf16 needs no loss scaling; fp16 (GPUs without bf16) uses a GradScaler, in one process only.
    amp_dtype = torch.bfloat16 if use_amp and torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp and amp_dtype == torch.float16)
    if scaler.is_enabled() and session.size > 1:
        raise ConfigError(
            "train.amp: this GPU has no bf16 and fp16 loss scaling is single-process only; set train.amp=false"
        )

    start, best_epoch = 1, None
    best_record: dict | None = None  # the best epoch's validation record (its tie-break metric too)
    records = read_metrics(metrics_path)
    if state is not None:
        model.load_state_dict(state["model"])
        base_optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state.get("scheduler"):
            scheduler.load_state_dict(state["scheduler"])
            scheduler.T_max = t.epochs
        set_rng_state(state["rng"])
        start, best_epoch = state["epoch"] + 1, state.get("best_epoch")
        records = [r for r in records if r["epoch"] <= state["epoch"]]  # drop epochs after the checkpoint
        best_record = next((r for r in records if r["epoch"] == best_epoch), None)
        if best_record is None and state.get("best_metric") is not None:
            best_record = {task.key_metric: state["best_metric"]}
        log.info("resuming %s at epoch %d of %d", cfg.run_dir, start, t.epochs)
    else:
        records = []
    optimizer = session.wrap_optimizer(base_optimizer, model)
    if state is not None:
        session.load_sync_state(optimizer, cfg.run_dir, state.get("dist"))
    if session.is_chief:
        save_config(cfg, cfg.run_dir / "config.yaml")

    reached = False  # the key metric reached train.stop_at (chief's decision, shared at the next epoch)
    last = min(stop, t.epochs)
    for epoch in range(start, min(stop, t.epochs) + 1):
        seed_epoch(data, t.seed, epoch, session.rank)
        session.start_epoch()
        if t.stop_at and session.share_state(reached):
            last = epoch - 1
            break
        model.train()
        tic, losses = time.perf_counter(), []
        bar = tqdm(
            data.train_loader, desc=f"{cfg.name} epoch {epoch}/{t.epochs}", leave=False, disable=not progress
        )
        for step, batch in enumerate(bar):
            inputs, targets = _plain(batch["image"].to(device)), _plain(task.targets(batch, device))
            optimizer.zero_grad(set_to_none=True)
            with session.compute():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
                    loss = task.step_loss(model, inputs, targets)
                scaler.scale(loss).backward()
            if scaler.is_enabled():
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            session.after_step(epoch, step, int(inputs.shape[0]))
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if scheduler is not None:
            scheduler.step()
        record: dict[str, Any] = {
            "epoch": epoch,
            "train_loss": sum(losses) / len(losses),
            "lr": base_optimizer.param_groups[0]["lr"],
            "epoch_s": round(time.perf_counter() - tic, 3),
        }
        record.update(session.end_epoch(optimizer))
        sync_marker = session.save_sync_state(optimizer, cfg.run_dir, epoch)  # each rank's residuals, locally
        site_local = session.gather_site_local(
            optimizer
        )  # local_norm: each site's own norm tensors, on rank 0
        due = epoch % t.val_interval == 0 or epoch == t.epochs
        scores: dict[str, Any] = {}
        val_tic = time.perf_counter()
        if session.validates and data.val_loader is not None and due:
            session.phase("validate")
            model.eval()
            scores = task.validate(model, data.val_loader, device)
        if cfg.sites and due:
            # each site's leader scored its own held-out cases; only the scores travel, to rank 0
            session.phase("wait")
            per_site = session.gather_site_metrics({**scores, "val_cases": len(data.val_items)})
            if per_site is not None:
                from medseg.distributed.site_data import pool_metrics

                scores = {**pool_metrics(per_site), "sites": per_site}
        if not session.is_chief:
            continue  # rank 0 alone writes; the others wait for it at the next epoch
        record.update(scores)
        if scores:
            record["val_s"] = round(time.perf_counter() - val_tic, 3)
        record["time"] = round(time.time(), 3)  # wall clock after validation: time-to-accuracy curves
        record["train_start"] = round(train_start, 3)
        session.phase("save")
        metric = record.get(task.key_metric)
        is_best = improves(record, best_record, task.key_metric, task.tie_metric)
        if is_best:
            best_epoch, best_record = epoch, record
        payload = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "epoch": epoch,
            "best_metric": best_record.get(task.key_metric) if best_record else None,
            "best_epoch": best_epoch,
            "rng": rng_state(),
            "config": cfg.to_dict(),
            "labels": {str(k): v for k, v in labels.items()},
        }
        if sync_marker is not None:
            payload["dist"] = sync_marker
        if site_local:
            payload["site_local"] = site_local  # for per-site evaluation of the bundle
        save_checkpoint(payload, last_path)
        if is_best or data.val_loader is None:
            save_checkpoint(payload, best_path)
        records.append(record)
        reached = bool(t.stop_at and metric is not None and metric >= t.stop_at and epoch >= t.min_epochs)
        if reached:
            log.info(
                "%s %.4f reached train.stop_at %.4f at epoch %d: stopping",
                task.key_metric,
                metric,
                t.stop_at,
                epoch,
            )
        write_metrics(metrics_path, records)
        plot_learning_curve(records, task.key_metric, cfg.run_dir / "learning_curve.png")
        shown = " ".join(f"{k}={v:.4f}" for k, v in record.items() if isinstance(v, float) and k != "epoch_s")
        log.info("epoch %d/%d %s (%.1fs)", epoch, t.epochs, shown, record["epoch_s"])

    if not session.is_chief:
        return TrainResult(cfg.run_dir, last, None, None, task.key_metric, {})
    best_metric = best_record.get(task.key_metric) if best_record else None
    if stop < t.epochs and last == stop:
        log.info("stopped after epoch %d of %d; continue with --resume", stop, t.epochs)
        return TrainResult(cfg.run_dir, stop, best_metric, best_epoch, task.key_metric, records[-1])
    best_state = load_checkpoint(best_path)
    exported = next((r for r in records if r["epoch"] == best_state["epoch"]), {})
    export_bundle(cfg, best_state, metrics={k: v for k, v in exported.items() if k.startswith("val_")})
    final = records[-1] if records else {}
    return TrainResult(cfg.run_dir, last, best_metric, best_epoch, task.key_metric, final)
