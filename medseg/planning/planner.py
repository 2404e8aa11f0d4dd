"""``medseg plan``: from a dataset's fingerprint to a config that ``medseg train`` runs as it is.

The choices, each written into the YAML as a comment naming the fact it came from:

1. **Target spacing** (nnU-Net's rule): the median spacing along R, A, S. When the coarsest axis is
   more than 3x coarser than the finest other axis *and* has fewer than a third of their voxels
   (thick slices), it takes the 10th percentile of its spacings instead (but not finer than the
   other axes), so thick-slice cases are not interpolated into many invented slices.
2. **Normalisation** of channel 0 by modality (``dataset.json``): CT is clipped to the foreground
   0.5-99.5 percentiles and z-scored with the foreground mean and standard deviation; anything else
   (MR, ...) is z-scored per image over its non-zero voxels (:func:`medseg.training.transforms.intensity`).
3. **Network**: DynUNet (kernels and strides from patch and spacing by nnU-Net's rule,
   :func:`medseg.models.dynunet_plan`; filters 32 doubling to 320), UNet (channels from a base width
   doubling per level, capped at 320; as many stride-2 levels as keep every axis >= 4 voxels) or
   SegResNet (MONAI's 4 stages). Default: DynUNet on CUDA, a small UNet on CPU.
4. **Patch and batch** from a memory model measured, not guessed, on the candidate patch's own
   network. A network's *topology* is its ``network_def`` at that patch: DynUNet's kernels and
   strides (nnU-Net's rule follows the patch: more levels, in-plane-only levels on anisotropic data),
   UNet's stride-2 levels, SegResNet's fixed 4 stages. For each topology the search meets,
   :mod:`medseg.bench.measure` runs that exact network's training step (forward, Dice+CE loss,
   backward, AdamW; fused kernels and the fused loss with ``--fused``) at two probe patches, each in
   its own process: the candidate patch scaled to about 32k and 98k voxels (the larger at most the
   candidate itself, the smaller at most 40% of the larger), rounded per axis to whole multiples of the
   topology's total stride ``S`` (the product of its strides; the deepest level keeps >= 2 voxels).
   With kernels and strides fixed, every level of the probe has the candidate's channels and only
   its maps shrink, so memory per voxel transfers from the probe to the candidate. Per probe,
   ``peak - 4 P = c + b (B V)``, where ``peak`` is the step's measured peak above the memory in use
   before it, ``P`` the network's parameters (their gradients are ``4 P`` bytes), ``B V`` the voxels
   in the batch; two probes give ``b`` (bytes per batch voxel) and ``c``. The candidate's step peak is
   predicted as ``4 P + c + b B V`` and its total as that plus ``12 P`` (weights and AdamW's two
   moments) plus the batch (``8 B V``: image and label as float32). The step time is fitted the same
   way: ``t = t0 + k B V``. Models are cached per topology: two probe processes per topology met
   (``Plan.probe_runs``); without a time budget each probe times one step instead of three.
   Probing a different topology does not transfer: probes at small patches with their own
   (shallower) DynUNet topologies predicted 873 MiB for a plan measured at 1365 MiB (-36%).

   The patch starts as the median image at the target spacing (rounded up to the network's
   divisor) and shrinks, one divisor step on the axis whose patch is largest relative to the median
   image, until the predicted total is within ``SAFETY`` (90%) of the budget and, on ``--device cpu``,
   ``steps`` training steps take at most ``TRAIN_SHARE`` of ``--time-s``. If the patch then sees less
   than a quarter of a median image (nnU-Net's low-resolution rule), the spacing is coarsened by 5%
   steps (finest axes first, up to the coarsest) and the search is repeated. The batch is 2, raised
   while the memory and the time allow and while one batch holds at most 5% of the dataset's voxels.
   The batch counts patches per step: the config holds it as ``train.batch_size`` cases times
   ``transforms.num_samples`` patches drawn from each, and ``--verify`` measures that many.
5. **Classification**: the image's object (:class:`medseg.training.transforms.ObjectMask`) is cropped and
   resized whole into a cubic patch whose side holds the largest object bounding box of the dataset
   at the target spacing (``transforms.roi: object``), instead of the volume's centre.

``--verify`` trains two steps (a warm-up and the measured one) of the planned network at the planned
patch and batch, in a fresh process, and reports the measured peak against the prediction and the
budget.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from medseg.config import Config, config_from_dict
from medseg.errors import ConfigError, MedsegError

log = logging.getLogger(__name__)

GB = 2**30
# The predicted total must stay within this share of the memory budget: the margin covers the model's
# error (measured by --verify, docs/benchmarks.md "Planning": -0.4% to +2.1% on UNet, SegResNet,
# DynUNet and fused UNet; -6% on fused UNet when its probes had another topology) and run-to-run
# allocator variation, so that the measured peak stays under the budget while the prediction is at
# most 10% low.
SAFETY = 0.9
TRAIN_SHARE = 0.8  # share of the time budget for training steps (the rest: loading, validation)
MIN_COVER = 0.25  # nnU-Net: the patch should see at least a quarter of a median image
DEFAULT_STEPS = {"cpu": 1000, "cuda": 25000}  # training steps of the planned batch (patches per step)
NUM_SAMPLES = 4  # at most this many patches drawn per cached volume per step (as the demo)
# The demo's segmentation training (configs/demo-seg.yaml; tests/planning/test_plan.py checks they agree): on
# --device cpu without --time-s, a plan may cost at most what the demo's DEMO_STEPS steps of
# DEMO_BATCH cases x DEMO_SAMPLES patches cost (80 epochs of ceil(13 / 4) steps on its 13 training
# cases), both measured in the same run (process CPU seconds, so the load of a shared machine cancels).
DEMO_MODEL = {"name": "unet", "channels": [16, 32, 64], "strides": [2, 2], "num_res_units": 1}
DEMO_PATCH, DEMO_BATCH, DEMO_SAMPLES, DEMO_STEPS = [32, 32, 16], 4, 4, 320


@dataclass
class Probe:
    shape: list[int]
    batch: int
    params: int
    step_peak: int
    static: int
    step_s: float
    step_cpu_s: float


@dataclass
class MemoryModel:
    """Fit of ``step_peak - 4P = c + b·BV`` and ``step time = t0 + k·BV`` over measured probes.

    Step time is process CPU seconds with ``cpu_time`` (a budget relative to an anchor measured in
    the same run), else wall seconds (a budget in seconds, ``--time-s``)."""

    variant: str
    probes: list[Probe]
    cpu_time: bool = True
    topology: str = ""  # the probed network's kernels/strides or channels, in words
    b: float = 0.0
    c: float = 0.0
    k: float = 0.0
    t0: float = 0.0

    def fit(self) -> MemoryModel:
        x = np.array([p.batch * math.prod(p.shape) for p in self.probes], dtype=np.float64)
        y = np.array([p.step_peak - 4 * p.params for p in self.probes], dtype=np.float64)
        t = np.array([p.step_cpu_s if self.cpu_time else p.step_s for p in self.probes], dtype=np.float64)
        self.b, self.c = (float(v) for v in np.polyfit(x, y, 1))
        self.k, self.t0 = (float(v) for v in np.polyfit(x, t, 1))
        if self.b <= 0:
            raise MedsegError(
                f"memory probes gave no growth with patch size ({[p.step_peak for p in self.probes]} bytes); "
                "the machine may be swapping or the measurement disturbed; run `medseg plan` again"
            )
        self.k = max(self.k, 1e-12)
        return self

    def step_peak(self, params: int, voxels: int) -> float:
        return 4 * params + self.c + self.b * voxels

    def total(self, params: int, voxels: int) -> float:
        return self.step_peak(params, voxels) + 12 * params + 8 * voxels

    def step_s(self, voxels: int) -> float:
        return max(self.t0 + self.k * voxels, 1e-6)


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


# ---------------------------------------------------------------------------------------------------
# spacing and normalisation


def target_spacing(fp: dict[str, Any]) -> tuple[list[float], str]:
    """nnU-Net's rule (module docstring, 1.) and the reason, in words."""
    target = list(fp["median_spacing"])
    size = list(fp["median_shape"])
    worst = int(np.argmax(target))
    others = [a for a in range(3) if a != worst]
    aniso_spacing = target[worst] > 3 * max(target[a] for a in others)
    aniso_voxels = size[worst] * 3 < min(size[a] for a in others)
    if aniso_spacing and aniso_voxels:
        p10 = fp["spacing_p10"][worst]
        chosen = max(p10, max(target[a] for a in others) + 1e-5)
        reason = (
            f"median {_mm(target)}; axis {'RAS'[worst]} is anisotropic (> 3x the others' spacing, < 1/3 of "
            f"their voxels): its 10th percentile {p10:.3g} mm"
        )
        target[worst] = chosen
        return target, reason
    return (
        target,
        f"median spacing of {fp['num_cases']} cases, {_mm(target)} (not anisotropic by nnU-Net's rule)",
    )


def normalisation(fp: dict[str, Any]) -> tuple[dict[str, Any], str]:
    modality = str(fp["modality"]).upper()
    it = fp.get("foreground_intensity")
    if modality == "CT":
        if not it:
            raise MedsegError(
                f"{fp['dataset']}: a CT dataset without foreground voxels; its labels are all background"
            )
        norm = {
            "scheme": "ct",
            "clip": [round(it["p0_5"], 3), round(it["p99_5"], 3)],
            "mean": round(it["mean"], 3),
            "std": round(max(it["std"], 1e-3), 3),
        }
        why = (
            f"modality CT (dataset.json): clip to the foreground 0.5/99.5 percentiles, z-score with the "
            f"foreground mean and std ({it['samples']} foreground voxels sampled)"
        )
        return norm, why
    return {"scheme": "zscore"}, f"modality {modality} (dataset.json) has no physical unit: z-score per image"


def _mm(v: list[float]) -> str:
    return " x ".join(f"{x:.3g}" for x in v) + " mm"


# ---------------------------------------------------------------------------------------------------
# networks


def _levels(patch: list[int], max_levels: int) -> int:
    """Stride-2 levels that keep every axis at >= 4 voxels and divide the patch."""
    n = 0
    while n < max_levels and all(p % 2 ** (n + 1) == 0 and p // 2 ** (n + 1) >= 4 for p in patch):
        n += 1
    return n


def model_section(
    net: str, device: str, patch: list[int], spacing: list[float]
) -> tuple[dict[str, Any], str]:
    """The ``model`` mapping for ``net`` at ``patch`` and why."""
    small = device == "cpu"
    if net == "unet":
        base, cap = (16, 3) if small else (32, 4)
        n = max(_levels(patch, cap), 1)
        channels = [min(base * 2**i, 320) for i in range(n + 1)]
        return (
            {"name": "unet", "channels": channels, "strides": [2] * n, "num_res_units": 1 if small else 2},
            f"UNet: {n} stride-2 levels keep every patch axis >= 4 voxels; width {base} doubling per level"
            + (" (small: CPU)" if small else "")
            + ", capped at 320",
        )
    if net == "segresnet":
        base = 8 if small else 16
        return (
            {"name": "segresnet", "init_filters": base, "norm": "group"},
            f"SegResNet (MONAI's 4 stages, 3 downsamplings), {base} initial filters"
            + (" (small: CPU)" if small else ""),
        )
    if net == "dynunet":
        from medseg.models import dynunet_plan

        kernels, strides = dynunet_plan(patch, spacing)
        return (
            {"name": "dynunet"},
            f"DynUNet by nnU-Net's rule from patch and spacing: kernels {kernels}, strides {strides}, "
            "filters 32 doubling to 320",
        )
    raise ConfigError(f"--net: {net!r} is not a network the planner knows (unet, segresnet, dynunet)")


def _divisor(net: str, device: str) -> int:
    return {"unet": 8 if device == "cpu" else 16, "segresnet": 8, "dynunet": 16}[net]


def _valid(net: str, patch: list[int], spacing: list[float]) -> bool:
    if net == "dynunet":
        from medseg.models import dynunet_plan

        try:
            dynunet_plan(patch, spacing)
        except ConfigError:
            return False
    return True


def _cfg(base: dict[str, Any], patch: list[int], model: dict[str, Any]) -> Config:
    d = json.loads(json.dumps(base))
    d["transforms"]["patch"] = list(patch)
    d["model"] = model
    return config_from_dict(d)


def _net_def(cfg: Config, classes: int) -> dict[str, Any]:
    from medseg.models import network_def

    return network_def(cfg, out_channels=classes)


def _params(net_def: dict[str, Any]) -> int:
    from medseg.models import build_network

    return sum(p.numel() for p in build_network(net_def).parameters())


# ---------------------------------------------------------------------------------------------------
# measuring


def run_measure(
    net_def: dict[str, Any],
    shape: list[int],
    batch: int,
    variant: str,
    device: str,
    classes: int,
    steps: int = 1,
) -> dict[str, Any]:
    """One :mod:`medseg.bench.measure` run in a fresh process (the only honest peak; docs/design.md)."""
    cmd = [sys.executable, "-m", "medseg.bench.measure", "--net", "unet", "--variant", variant]
    cmd += ["--shape", *map(str, shape), "--batch", str(batch), "--steps", str(steps), "--device", device]
    cmd += ["--classes", str(classes), "--net-def", json.dumps(net_def)]
    if device == "cpu":
        # One thread: process CPU time is then the step's own work; idle OpenMP threads spinning on a
        # shared, loaded machine would count as CPU time and make the time fit noise.
        cmd += ["--threads", "1"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MedsegError(f"memory probe {shape} x{batch} ({variant}) failed: {last[:300]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROBE_VOXELS = (32_768, 98_304)  # probe patch sizes (voxels), capped at the candidate patch's own size


def _total_stride(net_def: dict[str, Any]) -> list[int]:
    """Per axis, the product of the network's downsampling strides: a probe patch must divide by it."""
    target = net_def["_target_"].rsplit(".", 1)[-1]
    if target == "DynUNet":
        return [math.prod(s[a] for s in net_def["strides"]) for a in range(3)]
    if target == "UNet":
        return [math.prod(net_def["strides"])] * 3
    if target == "SegResNet":
        return [2 ** (len(net_def.get("blocks_down", (1, 2, 2, 4))) - 1)] * 3
    # model_section builds only these three
    raise ConfigError(f"plan: no probe rule for {target}")  # pragma: no cover


def _probe_shapes(patch: list[int], stride: list[int]) -> list[list[int]]:
    """Two probe patches for the network of ``patch``, whose downsampling strides multiply to ``stride``.

    Each is the candidate patch scaled to about ``PROBE_VOXELS`` (the larger at most the candidate
    itself, the smaller at most 40% of the larger) and rounded to whole multiples of ``stride`` per
    axis, so every level of the probe's network has the same kernels, strides and channels as the
    candidate's, only smaller maps; the deepest level keeps at least 2 voxels (instance norm needs
    more than one in training)."""
    cells = [p // s for p, s in zip(patch, stride)]  # the bottleneck's voxels along each axis
    total = math.prod(patch)
    big = min(PROBE_VOXELS[1], total)
    out = []
    for voxels in (min(PROBE_VOXELS[0], 0.4 * big), big):
        scale = (voxels / total) ** (1 / 3)
        q = [min(c, max(1, round(c * scale))) for c in cells]
        while math.prod(q) < 2:
            a = int(np.argmin(q))
            q[a] += 1
        out.append(q)
    if math.prod(out[0]) >= math.prod(out[1]):  # a small candidate: make the probes differ
        a = int(np.argmax(out[0]))
        if out[0][a] > 1 and math.prod(out[0]) // out[0][a] * (out[0][a] // 2) >= 2:
            out[0][a] //= 2
        else:
            a = int(np.argmin(out[1]))
            out[1][a] *= 2
    return [[c * s for c, s in zip(q, stride)] for q in out]


def _topology_text(net_def: dict[str, Any]) -> str:
    if "kernel_size" in net_def:
        return f"kernels {net_def['kernel_size']}, strides {net_def['strides']}"
    if "channels" in net_def:
        return f"channels {net_def['channels']}, strides {net_def['strides']}"
    return f"{net_def['init_filters']} initial filters"


class MemoryModels:
    """Memory (and step time) models measured per network topology, each on first use.

    The network of a candidate patch is its ``network_def`` (for DynUNet, kernels and strides by
    nnU-Net's rule from that patch; for UNet, its stride-2 levels). Its model is fitted from two probe
    runs of *that* network (:func:`_probe_shapes`), cached under the definition, so the search measures
    each topology it meets once, with two processes."""

    def __init__(
        self,
        base: dict[str, Any],
        net: str,
        device: str,
        classes: int,
        fused: bool,
        cpu_time: bool,
        timed: bool = True,
    ) -> None:
        self.base, self.net, self.device, self.classes = base, net, device, classes
        self.variant = "fused" if fused else "baseline"
        self.cpu_time, self.timed = cpu_time, timed
        self.models: dict[str, MemoryModel] = {}
        self.params: dict[str, int] = {}
        self.runs = 0  # probe processes started

    def net_def(self, patch: list[int], spacing: list[float]) -> dict[str, Any]:
        model, _ = model_section(self.net, self.device, patch, spacing)
        return _net_def(_cfg(self.base, patch, model), self.classes)

    def count_params(self, nd: dict[str, Any]) -> int:
        key = json.dumps(nd, sort_keys=True)
        if key not in self.params:
            self.params[key] = _params(nd)
        return self.params[key]

    def get(self, patch: list[int], spacing: list[float]) -> tuple[MemoryModel, int]:
        """The model of ``patch``'s network (measured now if its topology is new) and its parameters."""
        nd = self.net_def(patch, spacing)
        key = json.dumps(nd, sort_keys=True)
        if key not in self.models:
            probes = []
            for shape in _probe_shapes(patch, _total_stride(nd)):
                log.info(
                    "plan: measuring %s (%s) %s at %s, batch 2",
                    self.net,
                    self.variant,
                    _topology_text(nd),
                    shape,
                )
                # without a time budget one timed step is enough (the step time fit is then unused)
                r = run_measure(
                    nd, shape, 2, self.variant, self.device, self.classes, steps=3 if self.timed else 1
                )
                self.runs += 1
                probes.append(
                    Probe(
                        shape,
                        2,
                        r["params"],
                        r["peak_bytes"],
                        r["static_bytes"],
                        r["step_s"],
                        r["step_cpu_s"],
                    )
                )
            self.models[key] = MemoryModel(self.variant, probes, self.cpu_time, _topology_text(nd)).fit()
            self.params[key] = probes[0].params
        return self.models[key], self.count_params(nd)


def demo_anchor(base: dict[str, Any], classes: int, device: str) -> dict[str, Any]:
    """The demo network's training step, measured now (the CPU time budget's unit)."""
    nd = _net_def(_cfg(base, DEMO_PATCH, dict(DEMO_MODEL)), classes)
    log.info("plan: measuring the demo's step (anchor of the time budget)")
    return run_measure(nd, DEMO_PATCH, DEMO_BATCH * DEMO_SAMPLES, "baseline", device, classes, steps=3)


# ---------------------------------------------------------------------------------------------------
# planning


def _fit_patch(
    net: str,
    device: str,
    spacing: list[float],
    median_shape: list[float],
    models: MemoryModels,
    budget: float,
    time_per_step: float | None,
) -> tuple[list[int], int, str, MemoryModel]:
    """Largest patch (batch 2) under memory and time; returns patch, its network's params, what bound
    it, and the memory model of its network (measured for that topology, :class:`MemoryModels`)."""
    div = _divisor(net, device)
    patch = [max(div, int(math.ceil(m / div)) * div) for m in median_shape]
    bound = "the median image fits whole"
    while True:
        valid = _valid(net, patch, spacing)
        over_mem = over_time = False
        if valid:
            mm, params = models.get(patch, spacing)
            vox = 2 * math.prod(patch)
            over_mem = mm.total(params, vox) > SAFETY * budget
            over_time = time_per_step is not None and mm.step_s(vox) > time_per_step
            if not over_mem and not over_time:
                return patch, params, bound, mm
        bound = "memory" if over_mem else ("time" if over_time else "divisibility")
        ratios = [p / m for p, m in zip(patch, median_shape)]
        order = sorted(range(3), key=lambda a: (-ratios[a], -patch[a]))
        for a in order:
            if patch[a] - div >= div:
                patch[a] -= div
                break
        else:
            for mm in models.models.values():
                log.info(
                    "plan: %s: memory fit %.0f B/voxel + %.0f MiB; time fit %.4f + %.3g x voxels; probes %s",
                    mm.topology,
                    mm.b,
                    mm.c / 2**20,
                    mm.t0,
                    mm.k,
                    mm.probes,
                )
            raise MedsegError(
                f"no patch of at least {div} voxels a side fits: the budget is too small "
                f"({budget / GB:.2f} GiB{'' if time_per_step is None else f', {time_per_step:.3f} s per step'}); "
                "raise --memory-gb or --time-s"
            )


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
) -> Plan:
    """Plan a config for ``dataset`` (see the module docstring). ``time_s=-1``: the device's default."""
    from medseg.planning.fingerprint import fingerprint, format_fingerprint

    fp, cached = fingerprint(dataset, refresh=refresh)
    print(format_fingerprint(fp) + ("  (cached)" if cached else ""), flush=True)
    dataset = Path(dataset)
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device: {device!r}; use cpu or cuda")
    if memory_gb is None:
        memory_gb = _default_memory_gb(device)
    if memory_gb <= 0:
        raise ConfigError(f"--memory-gb: must be positive, got {memory_gb}")
    budget = memory_gb * GB
    demo_budget = device == "cpu" and time_s == -1.0  # the default on cpu: the demo's compute
    time_s = None if time_s == -1.0 else (time_s or None)
    steps = steps or DEFAULT_STEPS[device]
    seg = fp["task"] == "segmentation"
    classes = len(fp["labels"])
    spacing, spacing_why = target_spacing(fp)
    norm, norm_why = normalisation(fp)
    name = name or f"plan-{Path(dataset).name}"
    comments: dict[str, str] = {"transforms.spacing": spacing_why, "transforms.normalize": norm_why}
    base: dict[str, Any] = {
        "name": name,
        "task": fp["task"],
        "data": {"dir": str(dataset), "val_fraction": 0.2, "cache": "memory"},
        "transforms": {"spacing": [round(s, 4) for s in spacing], "normalize": norm},
        "model": {},
        "train": {"device": device},
    }
    if not seg:
        return _plan_classification(fp, base, comments, budget, device, memory_gb)

    net = net or ("unet" if device == "cpu" else "dynunet")
    n_train = max(1, int(round(fp["num_cases"] * 0.8)))
    timed = demo_budget or bool(time_s)
    models = MemoryModels(base, net, device, classes, fused, demo_budget, timed)
    anchor = None
    if demo_budget:
        anchor = demo_anchor(base, classes, device)
        time_per_step = anchor["step_cpu_s"] * DEMO_STEPS / steps
    elif time_s:
        time_per_step = TRAIN_SHARE * time_s / steps
    else:
        time_per_step = None
    notes: list[str] = []
    coarsened = False
    for _ in range(60):
        median_shape = _median_at(fp, spacing)
        patch, params, bound, mm = _fit_patch(
            net, device, spacing, median_shape, models, budget, time_per_step
        )
        cover = math.prod(patch) / math.prod(median_shape)
        if cover >= MIN_COVER or bound == "the median image fits whole":
            break
        spacing, coarsened = _coarser(spacing), True
    else:  # pragma: no cover - 60 steps of 5% is 18x coarser
        notes.append("spacing coarsened 60 times; the patch still sees less than a quarter of an image")
    if coarsened:
        comments["transforms.spacing"] += (
            f"; coarsened to {_mm(spacing)} because the largest patch that fits the {bound} budget saw less "
            f"than {MIN_COVER:.0%} of a median image (nnU-Net's low-resolution rule)"
        )
        base["transforms"]["spacing"] = [round(s, 4) for s in spacing]
    median_shape = _median_at(fp, spacing)
    # batch: 2, raised while memory and time allow and one batch is at most 5% of the dataset's voxels
    dataset_vox = fp["num_cases"] * math.prod(median_shape)
    batch = 2
    while True:
        nb = batch + 1
        vox = nb * math.prod(patch)
        if (
            mm.total(params, vox) > SAFETY * budget
            or (time_per_step is not None and mm.step_s(vox) > time_per_step)
            or vox > 0.05 * dataset_vox
        ):
            break
        batch = nb
    vox = batch * math.prod(patch)
    model, model_why = model_section(net, device, patch, spacing)
    # A training step holds batch_size cases x num_samples patches drawn from each (medseg.training.data), so
    # the planned batch of patches is split into the most patches per case (<= NUM_SAMPLES) that
    # divides it: 2 -> 1 case x 2 patches, 8 -> 2 cases x 4.
    samples = max(d for d in range(1, NUM_SAMPLES + 1) if batch % d == 0)
    cases = batch // samples
    spe = max(1, math.ceil(n_train / cases))
    epochs = max(1, math.ceil(steps / spe))
    cfg = json.loads(json.dumps(base))
    cfg["transforms"].update({"patch": patch, "num_samples": samples})
    cfg["model"] = model
    cfg["train"].update(
        {"epochs": epochs, "batch_size": cases, "lr": 0.003 if device == "cpu" else 0.001, "seed": 0}
    )
    cfg["train"]["val_interval"] = max(1, epochs // 10)
    if fused:
        cfg["train"]["memory"] = "fused"
    cfg["infer"] = {"sw_batch_size": 4}
    cover = math.prod(patch) / math.prod(median_shape)
    pred_total, pred_step = mm.total(params, vox), mm.step_peak(params, vox)
    comments["transforms.patch"] = (
        f"largest patch within {SAFETY:.0%} of the budget ({_budget_text(memory_gb, time_s, steps, anchor is not None)}); bound by "
        f"{bound}; sees {cover:.0%} of the median image {' x '.join(f'{m:.0f}' for m in median_shape)} at this spacing"
    )
    comments["model"] = model_why + f"; {params / 1e6:.2f} M parameters"
    comments["train.batch_size"] = (
        f"{cases} case(s) x {samples} patches (transforms.num_samples) = {batch} patches per step: 2, raised "
        "while memory and time allow and a batch is at most 5% of the dataset's voxels"
    )
    comments["train.epochs"] = (
        f"{steps} steps of {spe} per epoch ({n_train} training cases, {cases} per step)"
    )
    comments["memory model"] = _memory_text(mm, params, vox, pred_step, pred_total, budget)
    if anchor is not None:
        comments["time"] = (
            f"compute budget: the demo's {DEMO_STEPS} steps of its UNet {DEMO_MODEL['channels']} at "
            f"{DEMO_PATCH} x{DEMO_BATCH * DEMO_SAMPLES} patches, measured now at {anchor['step_cpu_s']:.3f} CPU s/step "
            f"({anchor['step_s']:.3f} s wall); this plan's fit t = {mm.t0:.3f} + {mm.k * 1e6:.4f}e-6 x batch "
            f"voxels CPU s: {mm.step_s(vox):.3f} CPU s/step x {steps} steps = "
            f"{mm.step_s(vox) * steps / (anchor['step_cpu_s'] * DEMO_STEPS):.0%} of the demo's"
        )
    elif time_per_step is not None:
        comments["time"] = (
            f"measured step time fit t = {mm.t0:.3f} + {mm.k * 1e6:.4f}e-6 x batch voxels s: "
            f"{mm.step_s(vox):.3f} s/step x {steps} steps = {mm.step_s(vox) * steps:.0f} s of the "
            f"{time_s:.0f} s budget ({TRAIN_SHARE:.0%} for steps)"
        )
    return Plan(
        cfg,
        comments,
        fp,
        budget,
        device,
        fused,
        mm,
        pred_total,
        pred_step,
        mm.step_s(vox),
        params,
        notes,
        probe_runs=models.runs,
        topologies=len(models.models),
    )


def _median_at(fp: dict[str, Any], spacing: list[float]) -> list[float]:
    """Median image size (R, A, S) resampled to ``spacing`` (per case, then the median)."""
    sizes = [[n * s / t for n, s, t in zip(c["shape"], c["spacing"], spacing)] for c in fp["cases"]]
    return [float(v) for v in np.median(np.asarray(sizes), 0)]


def _coarser(spacing: list[float]) -> list[float]:
    """5% coarser: the axes finer than the coarsest first, then all (nnU-Net's low-resolution step)."""
    top = max(spacing)
    if any(s < top * 0.999 for s in spacing):
        return [min(s * 1.05, top) if s < top * 0.999 else s for s in spacing]
    return [s * 1.05 for s in spacing]


def _default_memory_gb(device: str) -> float:
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GB * 0.9
        return 8.0
    from medseg.sysinfo import available_memory

    return min(available_memory() / GB * 0.5, 8.0)


def _budget_text(memory_gb: float, time_s: float | None, steps: int, demo_budget_text: bool = False) -> str:
    t = f", {steps} steps in {TRAIN_SHARE:.0%} of {time_s:.0f} s" if time_s else ""
    if not time_s and demo_budget_text:
        t = f", {steps} steps at most the demo's compute"
    return f"{memory_gb:g} GiB{t}"


def _memory_text(mm: MemoryModel, params: int, vox: int, step: float, total: float, budget: float) -> str:
    probes = "; ".join(
        f"{'x'.join(map(str, p.shape))} x{p.batch}: step peak {p.step_peak / 2**20:.0f} MiB, {p.step_s:.3f} s"
        for p in mm.probes
    )
    return (
        f"measured with medseg.bench.measure ({mm.variant}) on the planned network ({mm.topology}) at "
        f"smaller patches {probes}; fit {mm.b:.0f} bytes per batch voxel "
        f"+ {mm.c / 2**20:.0f} MiB + gradients; predicted step peak {step / 2**20:.0f} MiB, total "
        f"{total / 2**20:.0f} MiB with weights, AdamW state and batch (budget {budget / 2**20:.0f} MiB)"
    )


def _plan_classification(
    fp: dict[str, Any],
    base: dict[str, Any],
    comments: dict[str, str],
    budget: float,
    device: str,
    memory_gb: float,
) -> Plan:
    spacing = base["transforms"]["spacing"]
    ext = fp.get("object_extent_mm") or [None] * 3
    if not all(ext):
        raise MedsegError(
            f"{fp['dataset']}: no object found in the images (Otsu threshold); cannot plan a crop"
        )
    side_vox = max(e["max"] / s for e, s in zip(ext, spacing))
    side = int(math.ceil(min(max(side_vox, 16), 128) / 8) * 8)
    cfg = json.loads(json.dumps(base))
    cfg["transforms"].update({"patch": [side] * 3, "roi": "object"})
    cfg["model"] = (
        {"name": "resnet", "depth": 10, "width": 0.5, "norm": "batch"}
        if device == "cpu"
        else {
            "name": "resnet",
            "depth": 18,
            "norm": "batch",
        }
    )
    cfg["train"].update({"epochs": 16 if device == "cpu" else 100, "batch_size": 8, "lr": 0.001, "seed": 0})
    comments["transforms.patch"] = (
        f"cube holding the largest object bounding box ({_mm([e['max'] for e in ext])}) at the target spacing, "
        f"{side_vox:.0f} voxels, rounded up to a multiple of 8"
    )
    comments["transforms.roi"] = (
        "object: crop each image to its object (Otsu threshold of a smoothed copy) and resize it whole into the "
        "patch, instead of the volume's centre"
    )
    comments["model"] = "3D ResNet" + (" (depth 10, half width: CPU)" if device == "cpu" else " 18")
    return Plan(cfg, comments, fp, budget, device, False)


# ---------------------------------------------------------------------------------------------------
# output


def to_yaml(p: Plan) -> str:
    """The config as YAML, each planned choice preceded by a comment naming its facts."""
    c = p.comments
    out = [
        f"# Planned by `medseg plan` for {p.fingerprint['dataset']} ({p.fingerprint['num_cases']} training cases, "
        f"{p.fingerprint['modality']}) on {p.device}" + (" with fused kernels" if p.fused else "") + ".",
        "# Fingerprint: medseg_fingerprint.json in the dataset folder. Each choice's reason is above it.",
    ]
    for key in ("memory model", "time"):
        if key in c:
            out += _wrap(f"{key}: {c[key]}", "")
    for note in p.notes:
        out += _wrap(note, "")
    cfg = p.config
    for section in ("name", "task"):
        out.append(f"{section}: {_scalar(cfg[section])}")
    for section in ("data", "transforms", "model", "train", "infer"):
        if section not in cfg:
            continue
        if section in c:
            out += _wrap(c[section], "")
        out.append(f"{section}:")
        for key, value in cfg[section].items():
            why = c.get(f"{section}.{key}")
            if why:
                out += _wrap(why, "  ")
            if isinstance(value, dict):
                out.append(f"  {key}:")
                out += [f"    {k}: {_scalar(v)}" for k, v in value.items()]
            else:
                out.append(f"  {key}: {_scalar(value)}")
    return "\n".join(out) + "\n"


def _scalar(value: Any) -> str:
    """A scalar or a flat list in YAML flow form (JSON is YAML)."""
    return json.dumps(value)


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    import textwrap

    return [f"{indent}# {line}" for line in textwrap.wrap(text, width - len(indent) - 2)]


def write_plan(p: Plan, out: str | Path) -> Path:
    """Write the YAML (temporary name, then rename) after checking that it loads as a config."""
    from medseg.config import load_config

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(to_yaml(p))
        load_config(tmp)  # the plan must be a config `medseg train` accepts as it is
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def verify(p: Plan) -> dict[str, Any]:
    """Two training steps at the planned patch and batch in a fresh process: measured vs predicted peak."""
    if p.memory is None:
        raise MedsegError("--verify: this plan has no measured memory model (classification)")
    cfg = config_from_dict(p.config)
    classes = len(p.fingerprint["labels"])
    nd = _net_def(cfg, classes)
    batch = cfg.train.batch_size * max(cfg.transforms.num_samples, 1)  # patches per training step
    r = run_measure(nd, list(cfg.transforms.patch), batch, p.memory.variant, p.device, classes, 1)
    measured_total = r["peak_bytes"] + r["static_bytes"]
    result = {
        "net": cfg.model.name,
        "variant": p.memory.variant,
        "patch": list(cfg.transforms.patch),
        "batch": batch,
        "predicted_step_peak_bytes": p.predicted_step_peak,
        "measured_step_peak_bytes": r["peak_bytes"],
        "predicted_total_bytes": p.predicted_total,
        "measured_total_bytes": measured_total,
        "budget_bytes": p.budget_bytes,
        "error": (p.predicted_total - measured_total) / measured_total,
        "step_error": (p.predicted_step_peak - r["peak_bytes"]) / r["peak_bytes"],
        "within_budget": measured_total <= p.budget_bytes,
        "measured_step_s": r["step_s"],
        "predicted_step_s": p.predicted_step_s,
    }
    p.verify = result
    return result


def format_verify(v: dict[str, Any]) -> str:
    mb = 2**20
    return (
        f"verify: {v['net']} ({v['variant']}) patch {'x'.join(map(str, v['patch']))} batch {v['batch']}: "
        f"measured peak {v['measured_total_bytes'] / mb:.0f} MiB (step {v['measured_step_peak_bytes'] / mb:.0f} MiB "
        f"+ weights, AdamW state, batch), predicted {v['predicted_total_bytes'] / mb:.0f} MiB "
        f"({v['error']:+.1%}; step alone {v['step_error']:+.1%}), budget {v['budget_bytes'] / mb:.0f} MiB: "
        f"{'within' if v['within_budget'] else 'OVER'} budget"
    )
