"""The planner's memory (and step time) model, measured, not guessed, on the candidate patch's own network.

A network's *topology* is its ``network_def`` at a patch: DynUNet's kernels and strides (nnU-Net's
rule follows the patch: more levels, in-plane-only levels on anisotropic data), UNet's stride-2
levels, SegResNet's fixed 4 stages. For each topology the search meets, :mod:`medseg.kernels.measure`
runs that exact network's training step (forward, Dice+CE loss, backward, AdamW; fused kernels and
the fused loss with ``--fused``) at two probe patches, each in its own process: the candidate patch
scaled to about 32k and 98k voxels (the larger at most the candidate itself, the smaller at most 40%
of the larger), rounded per axis to whole multiples of the topology's total stride ``S`` (the
product of its strides; the deepest level keeps >= 2 voxels).

With kernels and strides fixed, every level of the probe has the candidate's channels and only its
maps shrink, so memory per voxel transfers from the probe to the candidate. Per probe,
``peak - 4 P = c + b (B V)``, where ``peak`` is the step's measured peak above the memory in use
before it, ``P`` the network's parameters (their gradients are ``4 P`` bytes), ``B V`` the voxels in
the batch; two probes give ``b`` (bytes per batch voxel) and ``c``. The candidate's step peak is
predicted as ``4 P + c + b B V`` and its total as that plus ``12 P`` (weights and AdamW's two
moments) plus the batch (``8 B V``: image and label as float32). The step time is fitted the same
way: ``t = t0 + k B V``, from CPU seconds for the default budget (relative to the demo's step,
measured the same way) and from wall seconds for ``--time-s``; the latter come from a second process
per probe that runs the step as training does (torch's threads, glibc's own allocator), because the
memory probe's settings make a step 2-3x slower than training's (:func:`run_measure`). Models are
cached per topology: two probe processes per topology met (four with ``--time-s``); without a time
budget each probe times one step instead of three. A probe of another (shallower)
topology does not transfer, because its levels hold other maps and channels.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from medseg.config import Config, config_from_dict
from medseg.errors import ConfigError, MedsegError
from medseg.planning.rules import DEMO_BATCH, DEMO_MODEL, DEMO_PATCH, DEMO_SAMPLES, model_section

log = logging.getLogger(__name__)

PROBE_VOXELS = (32_768, 98_304)  # probe patch sizes (voxels), capped at the candidate patch's own size


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
    data_k: float = 0.0  # seconds per batch voxel of drawing the patches (medseg.planning.data_time)

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
        return max(self.t0 + (self.k + self.data_k) * voxels, 1e-6)

    def describe(self, params: int, vox: int, budget: float) -> str:
        """The probes, the fit and the prediction at ``vox`` batch voxels, in words (the plan's reason)."""
        probes = "; ".join(
            f"{'x'.join(map(str, p.shape))} x{p.batch}: step peak {p.step_peak / 2**20:.0f} MiB, {p.step_s:.3f} s"
            for p in self.probes
        )
        step, total = self.step_peak(params, vox), self.total(params, vox)
        return (
            f"measured with medseg.kernels.measure ({self.variant}) on the planned network ({self.topology}) at "
            f"smaller patches {probes}; fit {self.b:.0f} bytes per batch voxel "
            f"+ {self.c / 2**20:.0f} MiB + gradients; predicted step peak {step / 2**20:.0f} MiB, total "
            f"{total / 2**20:.0f} MiB with weights, AdamW state and batch (budget {budget / 2**20:.0f} MiB)"
        )


def config_at(base: dict[str, Any], patch: list[int], model: dict[str, Any]) -> Config:
    """``base`` (a config mapping) with ``patch`` and ``model``."""
    d = json.loads(json.dumps(base))
    d["transforms"]["patch"] = list(patch)
    d["model"] = model
    return config_from_dict(d)


def count_params(net_def: dict[str, Any]) -> int:
    from medseg.models import build_network

    return sum(p.numel() for p in build_network(net_def).parameters())


def run_measure(
    net_def: dict[str, Any],
    shape: list[int],
    batch: int,
    variant: str,
    device: str,
    classes: int,
    steps: int = 1,
    wall_clock: bool = False,
) -> dict[str, Any]:
    """One :mod:`medseg.kernels.measure` run in a fresh process (the only honest peak; docs/design.md).

    By default the run is set up for memory and CPU seconds: one thread and every large allocation
    mmap'd (``MALLOC_MMAP_THRESHOLD_``). Both slow a step down against training (measured on the
    2-core CPU machine at 40 x 56 x 40 x 2: the mmap threshold alone adds about 60% CPU, one thread
    against two about 2x wall), so ``wall_clock`` runs the step as ``medseg train`` does instead:
    torch's default threads and glibc's own allocator; its ``step_s`` is then the training step's
    wall time and its memory figures are not used."""
    cmd = [sys.executable, "-m", "medseg.kernels.measure", "--net", "unet", "--variant", variant]
    cmd += ["--shape", *map(str, shape), "--batch", str(batch), "--steps", str(steps), "--device", device]
    cmd += ["--classes", str(classes), "--net-def", json.dumps(net_def)]
    env = dict(os.environ)
    if not wall_clock:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        if device == "cpu":
            # One thread: process CPU time is then the step's own work; idle OpenMP threads spinning on a
            # shared, loaded machine would count as CPU time and make the time fit noise.
            cmd += ["--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MedsegError(f"memory probe {shape} x{batch} ({variant}) failed: {last[:300]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def total_stride(net_def: dict[str, Any]) -> list[int]:
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


def probe_shapes(patch: list[int], stride: list[int]) -> list[list[int]]:
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


def topology_text(net_def: dict[str, Any]) -> str:
    """The network's kernels and strides, channels, or initial filters, in words."""
    if "kernel_size" in net_def:
        return f"kernels {net_def['kernel_size']}, strides {net_def['strides']}"
    if "channels" in net_def:
        return f"channels {net_def['channels']}, strides {net_def['strides']}"
    return f"{net_def['init_filters']} initial filters"


class MemoryModels:
    """Memory (and step time) models measured per network topology, each on first use.

    The network of a candidate patch is its ``network_def`` (for DynUNet, kernels and strides by
    nnU-Net's rule from that patch; for UNet, its stride-2 levels). Its model is fitted from two probe
    runs of *that* network (:func:`probe_shapes`), cached under the definition, so the search measures
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
        data_k: float = 0.0,
    ) -> None:
        self.base, self.net, self.device, self.classes = base, net, device, classes
        self.data_k = data_k  # added to every model's step time (a wall-time budget's patch drawing)
        self.variant = "fused" if fused else "baseline"
        self.cpu_time, self.timed = cpu_time, timed
        self.models: dict[str, MemoryModel] = {}
        self.params: dict[str, int] = {}
        self.runs = 0  # probe processes started

    def for_net(self, net: str) -> MemoryModels:
        """Empty models of ``net`` measured as these are (same base config, classes, variant, clock)."""
        return MemoryModels(
            self.base, net, self.device, self.classes, self.variant == "fused",
            self.cpu_time, self.timed, self.data_k,
        )  # fmt: skip

    def net_def(self, patch: list[int], spacing: list[float]) -> dict[str, Any]:
        from medseg.models import network_def

        model, _ = model_section(self.net, self.device, patch, spacing)
        return network_def(config_at(self.base, patch, model), out_channels=self.classes)

    def count_params(self, nd: dict[str, Any]) -> int:
        key = json.dumps(nd, sort_keys=True)
        if key not in self.params:
            self.params[key] = count_params(nd)
        return self.params[key]

    def get(self, patch: list[int], spacing: list[float]) -> tuple[MemoryModel, int]:
        """The model of ``patch``'s network (measured now if its topology is new) and its parameters."""
        nd = self.net_def(patch, spacing)
        key = json.dumps(nd, sort_keys=True)
        if key not in self.models:
            probes = [self._probe(nd, shape) for shape in probe_shapes(patch, total_stride(nd))]
            self.models[key] = MemoryModel(
                self.variant, probes, self.cpu_time, topology_text(nd), data_k=self.data_k
            ).fit()
            self.params[key] = probes[0].params
        return self.models[key], self.count_params(nd)

    def time_at(self, mm: MemoryModel, patch: list[int], spacing: list[float], batch: int) -> None:
        """Time ``patch``'s network at the planned ``batch`` as training runs it and put the time fit
        through that point (``t0 = measured - k·BV``, the slope kept), for a wall-time budget.

        The two probes run batch 2 at smaller patches, so the fit extrapolates to the planned batch
        and multiplies their noise: two plans of the thin DynUNet on the same machine predicted
        1.136 and 0.595 s for its step (training ran it at 0.91-1.21 s). One run at the planned
        shape costs a few of its steps."""
        nd = self.net_def(patch, spacing)
        vox = batch * math.prod(patch)
        r = run_measure(nd, patch, batch, self.variant, self.device, self.classes, steps=5, wall_clock=True)
        self.runs += 1
        mm.t0 = r["step_s"] - mm.k * vox

    def _probe(self, nd: dict[str, Any], shape: list[int]) -> Probe:
        """One probe run of network ``nd`` at ``shape``, batch 2."""
        log.info(
            "plan: measuring %s (%s) %s at %s, batch 2",
            self.net,
            self.variant,
            topology_text(nd),
            shape,
        )
        # without a time budget one timed step is enough (the step time fit is then unused)
        r = run_measure(nd, shape, 2, self.variant, self.device, self.classes, steps=3 if self.timed else 1)
        self.runs += 1
        step_s = r["step_s"]
        if self.timed and not self.cpu_time:
            # a budget in wall seconds (--time-s): the step timed as training runs it, in a second process
            step_s = run_measure(
                nd, shape, 2, self.variant, self.device, self.classes, steps=3, wall_clock=True
            )["step_s"]
            self.runs += 1
        return Probe(shape, 2, r["params"], r["peak_bytes"], r["static_bytes"], step_s, r["step_cpu_s"])

    def log_fits(self) -> None:
        """Log every model measured so far (when no patch fits the budget)."""
        for mm in self.models.values():
            log.info(
                "plan: %s: memory fit %.0f B/voxel + %.0f MiB; time fit %.4f + %.3g x voxels; probes %s",
                mm.topology,
                mm.b,
                mm.c / 2**20,
                mm.t0,
                mm.k,
                mm.probes,
            )


def demo_anchor(base: dict[str, Any], classes: int, device: str) -> dict[str, Any]:
    """The demo network's training step, measured now (the CPU time budget's unit)."""
    from medseg.models import network_def

    nd = network_def(config_at(base, DEMO_PATCH, dict(DEMO_MODEL)), out_channels=classes)
    log.info("plan: measuring the demo's step (anchor of the time budget)")
    return run_measure(nd, DEMO_PATCH, DEMO_BATCH * DEMO_SAMPLES, "baseline", device, classes, steps=3)
