"""Building a run before its first epoch: device, dataset, model, optimizer, scheduler and AMP.

The order of :func:`build_run` is part of the run's reproducibility: the weights are drawn right after
``torch.manual_seed(train.seed)``, and the rank's speed is profiled before its cases are loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from medseg.config import Config
from medseg.distributed import LocalSession
from medseg.errors import ConfigError
from medseg.models import build_network, network_def
from medseg.training.data import make_train_data, path_digest, read_dataset
from medseg.training.run import Amp, Run, RunPaths, run_log
from medseg.training.tasks import ClassificationTask, SegmentationTask, make_task


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: cuda was asked for but torch sees no CUDA device; use auto or cpu")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW, Adam, or SGD with Nesterov momentum m (``train.momentum``): with b_0 = 0,
    b_t = m b_{t-1} + g_t and w_t = w_{t-1} - lr (g_t + m b_t), g_t including weight decay."""
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=True
        )
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    return cls(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)


def build_scheduler(
    cfg: Config, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Stepped once per epoch e = 0 .. E-1 (E = ``train.epochs``): cosine, lr_e = lr (1 + cos(pi e / E)) / 2;
    poly (nnU-Net's), lr_e = lr (1 - e / E)^0.9; or none."""
    if cfg.train.scheduler == "poly":
        return torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=cfg.train.epochs, power=0.9)
    if cfg.train.scheduler != "cosine":
        return None
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.train.epochs)


def build_amp(enabled: bool, session: LocalSession) -> Amp:
    """bf16 needs no loss scaling; fp16 (GPUs without bf16) uses a GradScaler, in one process only."""
    dtype = torch.bfloat16 if enabled and torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=enabled and dtype == torch.float16)
    if scaler.is_enabled() and session.size > 1:
        raise ConfigError(
            "train.amp: this GPU has no bf16 and fp16 loss scaling is single-process only; set train.amp=false"
        )
    return Amp(enabled, dtype, scaler)


def build_model(cfg: Config, labels: dict[int, str], device: torch.device) -> torch.nn.Module:
    """The configured network on ``device``, its blocks swapped for fused kernels with train.memory=fused."""
    model = build_network(network_def(cfg, out_channels=len(labels))).to(device)
    if cfg.train.memory == "fused":
        from medseg.kernels import optimize_memory
        from medseg.kernels.dispatch import backend_name

        report = optimize_memory(model)
        run_log.info("train.memory=fused (%s): %s", backend_name(), report.format())
    return model


def probe_batch(cfg: Config, num_classes: int, device: torch.device) -> dict[str, torch.Tensor]:
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


def profile_step(
    model: torch.nn.Module,
    task: SegmentationTask | ClassificationTask,
    probe: dict[str, torch.Tensor],
    device: torch.device,
    use_amp: bool,
) -> Callable[[], int]:
    """One forward and backward pass on ``probe`` (no update), for measuring this rank's speed.

    The probe is made before timing starts and has a training batch's shapes (the values do not change
    the cost), so neither loading nor caching is ever timed. Returns the samples it processed.
    """

    def step() -> int:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            loss = task.step_loss(model, probe["image"], probe["target"])
        loss.backward()
        model.zero_grad(set_to_none=True)
        return int(probe["image"].shape[0])

    return step


@contextmanager
def buffers_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put ``model``'s buffers back as they were on entry (the parameters are not updated inside).

    Profiling runs training-mode forwards on the probe: BatchNorm would fold the probe's statistics
    into its running estimates, r <- (1 - m) r + m mean(probe), once per timed step, and each rank
    times a different number of steps. The ranks' initial models would then differ by chance, and
    rank 0's would cross the WAN (:func:`~medseg.distributed.sync.common.one_initial_model`) on some
    runs and not on others.
    """
    saved = [b.detach().clone() for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(model.buffers(), saved):
                buffer.copy_(value)


def build_run(cfg: Config, session: LocalSession, paths: RunPaths, progress: bool) -> Run:
    """Read the dataset, build the model and its optimizer, profile this rank, load its cases."""
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    device = pick_device(t.device)
    use_amp = t.amp and device.type == "cuda"
    torch.manual_seed(t.seed)  # weight initialisation; each epoch reseeds its own draws
    session.phase("read")  # the dataset's list and headers; "load" below reads and caches the cases
    # With sites: this rank's own site's folder only. With several ranks each checks the files of the
    # cases it loads (make_train_data) rather than every case, so a rank's start-up grows with its own
    # share of the data; those checks come after train_start and so count in time to accuracy.
    several = session.size > 1
    split = read_dataset(cfg, session.data_dir(cfg), check_cases=not several)
    if cfg.sites:
        from medseg.distributed.site_data import dataset_facts

        # header facts against the other sites' before anything is built or trained
        session.check_sites(dataset_facts(split[0], len(split[1]), len(split[2]), cfg.train))
    labels = split[0].labels
    task = make_task(cfg, labels)
    model = build_model(cfg, labels, device)
    base_optimizer = build_optimizer(cfg, model)
    probe = probe_batch(cfg, len(labels), device)
    train_start = time.time()  # before profiling: time-to-accuracy counts it, not imports or start-up
    with buffers_kept(model):
        session.prepare(profile_step(model, task, probe, device, use_amp), model)
    session.phase("load")
    data = make_train_data(cfg, session, split, check_cases=several)  # this rank's own cases, cached once
    session.report(
        {
            "ev": "loaded",
            "cases": len(data.train_items),
            "cache_mb": round(data.cache_mb, 1),
            "site": session.site,
            # the one dataset folder this rank opened: its path leaves the site only with
            # data.share_paths, else a digest that the site's own staff can match
            "data": str(data.info.root) if cfg.data.share_paths else path_digest(data.info.root),
        }
    )
    scheduler = build_scheduler(cfg, base_optimizer)
    amp = build_amp(use_amp, session)
    return Run(
        cfg=cfg,
        session=session,
        paths=paths,
        device=device,
        labels=labels,
        task=task,
        model=model,
        base_optimizer=base_optimizer,
        scheduler=scheduler,
        amp=amp,
        data=data,
        train_start=train_start,
        progress=progress,
    )
