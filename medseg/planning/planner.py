"""``medseg plan``: from a dataset's fingerprint to a config that ``medseg train`` runs as it is.

The rules are in :mod:`medseg.planning.rules`, the measured memory model in
:mod:`medseg.planning.memory_model`; this module runs the search and records each choice's reason
(written into the YAML as a comment by :mod:`medseg.planning.plan_io`).

Segmentation: the patch starts as the median image at the target spacing (rounded up to the
network's divisor) and shrinks, one divisor step on the axis whose patch is largest relative to the
median image, until the predicted total (batch 2) is within ``SAFETY`` (90%) of the budget and, on
``--device cpu``, ``steps`` training steps take at most ``TRAIN_SHARE`` of ``--time-s`` (without
``--time-s`` on CPU: at most the demo's compute, measured now); the fitted patch is then grown back
one step at a time on any axis that still fits, since one step off a short axis can free more than
was needed. With ``--time-s`` and no ``--steps``,
the steps are then set to fill ``TRAIN_SHARE`` of the budget at the fitted patch and batch, so a larger
budget trains longer once the patch covers the image, and the thin DynUNet's step (timed last, at the
planned batch) never stretches training past the budget. If the patch then sees less than a
quarter of a median image, the spacing is coarsened and the search is repeated. The batch is then
raised from 2 (:mod:`medseg.planning.rules`, 4.). ``--verify`` measures the batch the config trains
with: ``train.batch_size`` cases times ``transforms.num_samples`` patches.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from medseg.errors import ConfigError, MedsegError
from medseg.planning.memory_model import MemoryModel, MemoryModels, demo_anchor
from medseg.planning.rules import (
    DEFAULT_STEPS,
    DEMO_BATCH,
    DEMO_MODEL,
    DEMO_PATCH,
    DEMO_SAMPLES,
    DEMO_STEPS,
    GB,
    MAX_BATCH_SHARE,
    MIN_COVER,
    SAFETY,
    THIN_DYNUNET_STEPS,
    TRAIN_SHARE,
    classification_model,
    coarser,
    default_memory_gb,
    divisor,
    epochs_for,
    median_at,
    mm_text,
    model_section,
    normalisation,
    object_patch_side,
    split_batch,
    target_spacing,
    valid_patch,
)

log = logging.getLogger(__name__)


@dataclass
class Plan:
    config: dict[str, Any]
    comments: dict[str, str]
    fingerprint: dict[str, Any]
    budget_bytes: float
    device: str
    fused: bool
    memory: MemoryModel | None = None
    predicted_total: float | None = None
    predicted_step_peak: float | None = None
    predicted_step_s: float | None = None
    params: int = 0
    notes: list[str] = field(default_factory=list)
    verify: dict[str, Any] | None = None
    probe_runs: int = 0  # probe processes the search started (two per topology it met)
    topologies: int = 0  # network topologies measured

    @property
    def patch_voxels(self) -> int:
        return math.prod(self.config["transforms"]["patch"])


@dataclass
class Budget:
    """What a plan may cost: memory (bytes) and, when set, training step time."""

    memory_gb: float
    bytes: float
    time_s: float | None  # --time-s; None: no wall-clock budget
    steps: int  # training steps of the planned batch
    demo: bool  # the CPU default: at most the demo's compute, measured now
    per_step: float | None = None  # seconds (CPU seconds with ``demo``) per training step
    anchor: dict[str, Any] | None = None  # the demo's measured step, with ``demo``
    fill: bool = False  # --time-s without --steps: the steps fill the time budget at the fitted patch


@dataclass
class PatchFit:
    """The search's result: the largest patch that fits, its network and what bound it."""

    patch: list[int]
    params: int
    bound: str
    memory: MemoryModel
    spacing: list[float]
    coarsened: bool
    notes: list[str]
    net: str = ""  # the planned network, where a time budget changed it (rules, 3.)


def plan(
    dataset: str | Path,
    memory_gb: float | None = None,
    device: str = "cpu",
    fused: bool = False,
    net: str | None = None,
    time_s: float | None = -1.0,
    steps: int | None = None,
    name: str | None = None,
    refresh: bool = False,
    report: Callable[[str], None] | None = None,
) -> Plan:
    """Plan a config for ``dataset`` (see the module docstring). ``time_s=-1``: the device's default.

    ``report`` receives the dataset's fingerprint in words as soon as it is read (the command line
    prints it); without it, the text is logged."""
    from medseg.planning.fingerprint import fingerprint, format_fingerprint

    fp, cached = fingerprint(dataset, refresh=refresh)
    (report or log.info)(format_fingerprint(fp) + ("  (cached)" if cached else ""))
    dataset = Path(dataset)
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device: {device!r}; use cpu or cuda")
    if memory_gb is None:
        memory_gb = default_memory_gb(device)
    if memory_gb <= 0:
        raise ConfigError(f"--memory-gb: must be positive, got {memory_gb}")
    budget = Budget(
        memory_gb,
        memory_gb * GB,
        None if time_s == -1.0 else (time_s or None),
        steps or DEFAULT_STEPS[device],
        device == "cpu" and time_s == -1.0,
        fill=steps is None and time_s not in (-1.0, 0, None),
    )
    spacing, base, comments = _base_config(fp, dataset, name, device)
    if fp["task"] != "segmentation":
        return _plan_classification(fp, base, comments, budget.bytes, device)
    net = net or ("unet" if device == "cpu" else "dynunet")
    return _plan_segmentation(fp, base, comments, spacing, budget, device, fused, net)


def _base_config(
    fp: dict[str, Any], dataset: Path, name: str | None, device: str
) -> tuple[list[float], dict[str, Any], dict[str, str]]:
    """The target spacing (unrounded), the config's sections every plan shares (spacing,
    normalisation) and their reasons."""
    spacing, spacing_why = target_spacing(fp)
    norm, norm_why = normalisation(fp)
    comments = {"transforms.spacing": spacing_why, "transforms.normalize": norm_why}
    base: dict[str, Any] = {
        "name": name or f"plan-{dataset.name}",
        "task": fp["task"],
        "data": {"dir": str(dataset), "val_fraction": 0.2, "cache": "memory"},
        "transforms": {"spacing": [round(s, 4) for s in spacing], "normalize": norm},
        "model": {},
        "train": {"device": device},
    }
    return spacing, base, comments


def _plan_segmentation(
    fp: dict[str, Any],
    base: dict[str, Any],
    comments: dict[str, str],
    spacing: list[float],
    budget: Budget,
    device: str,
    fused: bool,
    net: str,
) -> Plan:
    """The largest patch and batch the budget allows (module docstring), the epochs, and why."""
    classes = len(fp["labels"])
    n_train = max(1, int(round(fp["num_cases"] * 0.8)))
    timed = budget.demo or bool(budget.time_s)
    data_k = 0.0
    if budget.time_s and not budget.demo:  # wall seconds: the step includes drawing its patches
        from medseg.planning.data_time import data_s_per_voxel

        data_k = data_s_per_voxel(base, [max(8, round(m)) for m in median_at(fp, spacing)])
    models = MemoryModels(base, net, device, classes, fused, budget.demo, timed, data_k)
    _time_per_step(budget, base, classes, device)
    fit = _search(fp, net, device, spacing, models, budget)
    if fit.coarsened:
        comments["transforms.spacing"] += (
            f"; coarsened to {mm_text(fit.spacing)} because the largest patch that fits the {fit.bound} budget saw less "
            f"than {MIN_COVER:.0%} of a median image (nnU-Net's low-resolution rule)"
        )
        base["transforms"]["spacing"] = [round(s, 4) for s in fit.spacing]
    median_shape = median_at(fp, fit.spacing)
    batch = _batch(fit, budget, fp["num_cases"] * math.prod(median_shape))
    fit, net_why = _thin_dynunet(fit, batch, budget, models, net, device)
    net = fit.net or net
    cases, samples = split_batch(batch)
    if budget.fill and budget.time_s:
        # the steps the budget holds, fewer than the default where the timed step is slow
        budget.steps = int(TRAIN_SHARE * budget.time_s / fit.memory.step_s(batch * math.prod(fit.patch)))
    epochs, spe = epochs_for(budget.steps, n_train, cases)
    model, model_why = model_section(net, device, fit.patch, fit.spacing)
    cfg = _segmentation_config(base, fit.patch, samples, model, epochs, cases, fused)
    mm, params, vox = fit.memory, fit.params, batch * math.prod(fit.patch)
    cover = math.prod(fit.patch) / math.prod(median_shape)
    comments["transforms.patch"] = (
        f"largest patch within {SAFETY:.0%} of the budget ({_budget_text(budget)}); bound by "
        f"{fit.bound}; sees {cover:.0%} of the median image {' x '.join(f'{m:.0f}' for m in median_shape)} at this spacing"
    )
    comments["model"] = model_why + f"; {params / 1e6:.2f} M parameters" + net_why
    comments["train.batch_size"] = (
        f"{cases} case(s) x {samples} patches (transforms.num_samples) = {batch} patches per step: 2, raised "
        "while memory and time allow and a batch is at most 5% of the dataset's voxels"
    )
    comments["train.epochs"] = (
        f"{budget.steps} steps of {spe} per epoch ({n_train} training cases, {cases} per step)"
    )
    comments["memory model"] = mm.describe(params, vox, budget.bytes)
    time_why = _time_text(mm, vox, budget)
    if time_why:
        comments["time"] = time_why
    predicted = (mm.total(params, vox), mm.step_peak(params, vox), mm.step_s(vox))
    return Plan(
        cfg,
        comments,
        fp,
        budget.bytes,
        device,
        fused,
        mm,
        *predicted,
        params,
        fit.notes,
        probe_runs=models.runs,
        topologies=len(models.models),
    )


def _thin_dynunet(
    fit: PatchFit, batch: int, budget: Budget, models: MemoryModels, net: str, device: str
) -> tuple[PatchFit, str]:
    """``fit`` with the thin DynUNet (rules, 3.) in place of the CPU's small UNet where a ``--time-s``
    budget (without ``--steps``) trains it for at least ``THIN_DYNUNET_STEPS`` steps of ``batch``
    patches at the fitted patch and it fits the memory budget (its topology measured now); else
    ``fit`` as it is. Also the choice's reason, for the plan's comment."""
    if not (budget.fill and budget.time_s and net == "unet" and device == "cpu"):
        return fit, ""
    thin = models.for_net("dynunet-thin")
    try:
        mm, params = thin.get(fit.patch, fit.spacing)
    except ConfigError as e:  # the UNet's patch does not halve evenly by nnU-Net's rule (no probe ran)
        return fit, f"; no thin DynUNet at this patch ({e})"
    thin.time_at(mm, fit.patch, fit.spacing, batch)
    models.runs += thin.runs
    models.models.update(thin.models)
    vox = batch * math.prod(fit.patch)
    steps = int(TRAIN_SHARE * budget.time_s / mm.step_s(vox))
    why = (
        f"; the budget trains a thin DynUNet for {steps} steps at {mm.step_s(vox):.3f} s (timed at the"
        f" planned batch; it is chosen from {THIN_DYNUNET_STEPS} steps)"
    )
    if steps >= THIN_DYNUNET_STEPS and mm.total(params, vox) <= SAFETY * budget.bytes:
        return replace(fit, params=params, memory=mm, net="dynunet-thin"), why
    return fit, why + ", so the UNet stays"


def _time_per_step(budget: Budget, base: dict[str, Any], classes: int, device: str) -> None:
    """Set ``budget.per_step``: the demo's measured compute per planned step (the CPU default, which
    measures the demo's step now), or ``TRAIN_SHARE`` of ``--time-s`` per step; else no time bound."""
    if budget.demo:
        budget.anchor = demo_anchor(base, classes, device)
        budget.per_step = budget.anchor["step_cpu_s"] * DEMO_STEPS / budget.steps
    elif budget.time_s:
        budget.per_step = TRAIN_SHARE * budget.time_s / budget.steps


def _segmentation_config(
    base: dict[str, Any],
    patch: list[int],
    samples: int,
    model: dict[str, Any],
    epochs: int,
    cases: int,
    fused: bool,
) -> dict[str, Any]:
    """``base`` completed with the planned patch, network, batch and epochs."""
    cfg = json.loads(json.dumps(base))
    cfg["transforms"].update({"patch": patch, "num_samples": samples})
    cfg["model"] = model
    cpu = cfg["train"]["device"] == "cpu"
    cfg["train"].update({"epochs": epochs, "batch_size": cases, "lr": 0.003 if cpu else 0.001, "seed": 0})
    cfg["train"]["val_interval"] = max(1, epochs // 10)
    if fused:
        cfg["train"]["memory"] = "fused"
    cfg["infer"] = {"sw_batch_size": 4}
    return cfg


def _search(
    fp: dict[str, Any],
    net: str,
    device: str,
    spacing: list[float],
    models: MemoryModels,
    budget: Budget,
) -> PatchFit:
    """The largest patch that fits at the target spacing, coarsened while the patch sees less than
    ``MIN_COVER`` of a median image (unless the median image fits whole)."""
    notes: list[str] = []
    coarsened = False
    for _ in range(60):
        median_shape = median_at(fp, spacing)
        patch, params, bound, mm = _fit_patch(net, device, spacing, median_shape, models, budget)
        cover = math.prod(patch) / math.prod(median_shape)
        if cover >= MIN_COVER or bound == "the median image fits whole":
            break
        spacing, coarsened = coarser(spacing), True
    else:  # pragma: no cover - 60 steps of 5% is 18x coarser
        notes.append("spacing coarsened 60 times; the patch still sees less than a quarter of an image")
    return PatchFit(patch, params, bound, mm, spacing, coarsened, notes)


def _fit_patch(
    net: str,
    device: str,
    spacing: list[float],
    median_shape: list[float],
    models: MemoryModels,
    budget: Budget,
) -> tuple[list[int], int, str, MemoryModel]:
    """Largest patch (batch 2) under memory and time; returns patch, its network's params, what bound
    it, and the memory model of its network (measured for that topology, :class:`MemoryModels`).

    nnU-Net's rule: start from the median image (each axis rounded up to the network's divisor ``d``)
    and, while the patch does not fit, take ``d`` off the axis with the largest patch/median ratio.
    One step on a short axis can free more than was needed, so the fitted patch is then grown back
    (:func:`_grow_back`) until no axis can take ``d`` more."""
    div = divisor(net, device)
    cap = [max(div, int(math.ceil(m / div)) * div) for m in median_shape]
    patch, bound = list(cap), "the median image fits whole"
    while True:
        broke, mm, params = _try_patch(net, patch, spacing, models, budget)
        if not broke:
            patch, mm, params = _grow_back(net, div, patch, (cap, median_shape), spacing, models, budget)
            return patch, params, bound, mm
        if broke != "divisibility" or bound == "the median image fits whole":
            bound = broke  # an invalid patch keeps an earlier bound's name
        ratios = [p / m for p, m in zip(patch, median_shape)]
        order = sorted(range(3), key=lambda a: (-ratios[a], -patch[a]))
        for a in order:
            if patch[a] - div >= div:
                patch[a] -= div
                break
        else:
            models.log_fits()
            per_step = "" if budget.per_step is None else f", {budget.per_step:.3f} s per step"
            raise MedsegError(
                f"no patch of at least {div} voxels a side fits: the budget is too small "
                f"({budget.bytes / GB:.2f} GiB{per_step}); raise --memory-gb or --time-s"
            )


def _try_patch(
    net: str, patch: list[int], spacing: list[float], models: MemoryModels, budget: Budget
) -> tuple[str, Any, int]:
    """What a batch-2 patch breaks ('' when it fits, else 'memory', 'time' or 'divisibility'), with the
    memory model and parameter count of its network (None, 0 when the patch is invalid for it)."""
    if not valid_patch(net, patch, spacing):
        return "divisibility", None, 0
    mm, params = models.get(patch, spacing)
    vox = 2 * math.prod(patch)
    if mm.total(params, vox) > SAFETY * budget.bytes:
        return "memory", mm, params
    if budget.per_step is not None and mm.step_s(vox) > budget.per_step:
        return "time", mm, params
    return "", mm, params


def _grow_back(
    net: str,
    div: int,
    patch: list[int],
    shapes: tuple[list[int], list[float]],
    spacing: list[float],
    models: MemoryModels,
    budget: Budget,
) -> tuple[list[int], Any, int]:
    """A fitting patch grown ``div`` voxels at a time, the axis with the smallest patch/median ratio
    first, while it still fits and no axis passes ``cap``, the median image's shape rounded up to
    ``div`` (``shapes`` is ``(cap, median_shape)``); ends when every axis one step larger would break
    the budget, be invalid for the network, or pass ``cap``."""
    cap, median_shape = shapes
    _, mm, params = _try_patch(net, patch, spacing, models, budget)
    grown = True
    while grown:
        grown = False
        for a in sorted(range(3), key=lambda a: (patch[a] / median_shape[a], patch[a])):
            if patch[a] + div > cap[a]:
                continue
            trial = [p + (div if i == a else 0) for i, p in enumerate(patch)]
            broke, t_mm, t_params = _try_patch(net, trial, spacing, models, budget)
            if not broke:
                patch, mm, params, grown = trial, t_mm, t_params, True
                break
    return patch, mm, params


def _batch(fit: PatchFit, budget: Budget, dataset_vox: float) -> int:
    """Patches per step: 2, raised while memory and time allow and one batch is at most
    ``MAX_BATCH_SHARE`` of the dataset's voxels."""
    mm, batch = fit.memory, 2
    while True:
        vox = (batch + 1) * math.prod(fit.patch)
        if (
            mm.total(fit.params, vox) > SAFETY * budget.bytes
            or (budget.per_step is not None and mm.step_s(vox) > budget.per_step)
            or vox > MAX_BATCH_SHARE * dataset_vox
        ):
            return batch
        batch += 1


def _budget_text(budget: Budget) -> str:
    """The budget in words: memory, and the steps in the time budget or the demo's compute."""
    t = f", {budget.steps} steps in {TRAIN_SHARE:.0%} of {budget.time_s:.0f} s" if budget.time_s else ""
    if not budget.time_s and budget.anchor is not None:
        t = f", {budget.steps} steps at most the demo's compute"
    return f"{budget.memory_gb:g} GiB{t}"


def _time_text(mm: MemoryModel, vox: int, budget: Budget) -> str | None:
    """The time budget and the fitted step time at ``vox`` batch voxels, in words; None without a budget."""
    steps, step_s = budget.steps, mm.step_s(vox)
    if budget.anchor is not None:
        anchor = budget.anchor
        return (
            f"compute budget: the demo's {DEMO_STEPS} steps of its UNet {DEMO_MODEL['channels']} at "
            f"{DEMO_PATCH} x{DEMO_BATCH * DEMO_SAMPLES} patches, measured now at {anchor['step_cpu_s']:.3f} CPU s/step "
            f"({anchor['step_s']:.3f} s wall); this plan's fit t = {mm.t0:.3f} + {mm.k * 1e6:.4f}e-6 x batch "
            f"voxels CPU s: {step_s:.3f} CPU s/step x {steps} steps = "
            f"{step_s * steps / (anchor['step_cpu_s'] * DEMO_STEPS):.0%} of the demo's"
        )
    if budget.per_step is not None:
        return (
            f"measured step time fit t = {mm.t0:.3f} + {mm.k * 1e6:.4f}e-6 x batch voxels s, plus "
            f"{mm.data_k * 1e6:.4f}e-6 x batch voxels s drawing the patches (medseg.planning.data_time): "
            f"{step_s:.3f} s/step x {steps} steps = {step_s * steps:.0f} s of the "
            f"{budget.time_s:.0f} s budget ({TRAIN_SHARE:.0%} for steps)"
        )
    return None


def _plan_classification(
    fp: dict[str, Any],
    base: dict[str, Any],
    comments: dict[str, str],
    budget: float,
    device: str,
) -> Plan:
    """A cubic object crop (:mod:`medseg.planning.rules`, 5.) and a 3D ResNet; nothing is measured."""
    ext = fp.get("object_extent_mm") or [None] * 3
    if not all(ext):
        raise MedsegError(
            f"{fp['dataset']}: no object found in the images (Otsu threshold); cannot plan a crop"
        )
    side, side_vox = object_patch_side(ext, base["transforms"]["spacing"])
    model, model_why = classification_model(device)
    cfg = json.loads(json.dumps(base))
    cfg["transforms"].update({"patch": [side] * 3, "roi": "object"})
    cfg["model"] = model
    cfg["train"].update({"epochs": 16 if device == "cpu" else 100, "batch_size": 8, "lr": 0.001, "seed": 0})
    comments["transforms.patch"] = (
        f"cube holding the largest object bounding box ({mm_text([e['max'] for e in ext])}) at the target spacing, "
        f"{side_vox:.0f} voxels, rounded up to a multiple of 8"
    )
    comments["transforms.roi"] = (
        "object: crop each image to its object (Otsu threshold of a smoothed copy) and resize it whole into the "
        "patch, instead of the volume's centre"
    )
    comments["model"] = model_why
    return Plan(cfg, comments, fp, budget, device, False)
