"""Measuring one training step of a 3D network: saved-for-backward bytes, peak memory, step time.

Run as ``python -m medseg.kernels.measure --net unet --variant fused --patch 64`` it measures one
variant in this process and prints one JSON line; ``medseg bench memory`` starts one such process
per variant, because peak memory is only honest in a fresh process (docs/design.md):

* CPU peak: with ``MALLOC_MMAP_THRESHOLD_=65536`` set before the process starts (every large
  buffer is its own mapping, returned to the OS when freed), ``gc.collect()``, ``malloc_trim(0)``,
  ``5 > /proc/self/clear_refs`` to reset the high-water mark, one step, then ``VmHWM``. The figure
  reported is that high-water mark minus the resident size just before the step, i.e. what the
  step itself needs on top of the model, its optimizer state and the input batch.
* GPU peak: ``max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus the allocation
  before the step.
* Saved bytes: the unique storages handed to autograd for backward (``saved_tensors_hooks``),
  parameters excluded. Exact, but not the peak: backward's own buffers come on top. Reported for
  the network (``saved_bytes``) and for the loss alone (``loss_saved_bytes``).
* Phase peaks: the same high-water mark, reset at the start of each phase of the measured step
  (forward, loss, backward, optimizer), each above the step's starting memory. Their maximum is the
  step's peak, and the phase that sets it says what the rest of the peak is (``breakdown``):
  saved maps, the loss's transient maps, parameter gradient buffers (exact, from the parameters),
  and what remains: convolution workspace (oneDNN's reorders and scratch, which depend on the
  CPU's instruction set), the logits' gradient, and allocator slack. In backward, saved maps are freed as gradients appear, so the split is
  an upper bound on what is saved at the peak's instant.

The variant ``fused`` uses :class:`medseg.kernels.loss.FusedDiceCELoss` (what ``train.memory:
fused`` trains with), fused with the network's last convolution where that fuses (``head.py``:
UNet, DynUNet; ``head_fused`` in the result says which; the logits' gradient is then only ever one
slab's and counted as 0); the other variants MONAI's ``DiceCELoss(to_onehot_y=True, softmax=True)``.
Labels are float (N, 1, *spatial) class maps of smooth blobs, as medseg's pipeline hands them over,
with every class present.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

VARIANTS = ("baseline", "fused", "checkpoint", "compile")
NETS = ("unet", "segresnet", "dynunet")


def build_net(net: str, patch: int, width: float = 1.0, classes: int = 3) -> nn.Module:
    """The network medseg trains for ``net`` (its default config), 1 input channel, ``classes`` outputs.

    ``width`` scales every layer's channel count (the quick benchmark uses 0.5).
    """
    from medseg.config import config_from_dict
    from medseg.models import build_network, network_def

    model = {"name": net, "norm": "group" if net == "segresnet" else "instance"}
    cfg = config_from_dict({"model": model, "transforms": {"patch": [patch] * 3, "spacing": [1.5] * 3}})
    cfg.model.channels = [max(int(c * width), 4) for c in cfg.model.channels]
    cfg.model.init_filters = max(int(cfg.model.init_filters * width), 8)
    net_def = network_def(cfg, out_channels=classes)
    if net == "dynunet" and width != 1.0:  # MONAI's default DynUNet filters, scaled
        net_def["filters"] = [int(min(2 ** (5 + i), 320) * width) for i in range(len(net_def["strides"]))]
    return build_network(net_def)


def _checkpoint_blocks(model: nn.Module) -> int:
    """Wrap each residual block's forward in non-reentrant ``torch.utils.checkpoint``."""
    from monai.networks.blocks import ResidualUnit
    from monai.networks.blocks.dynunet_block import UnetBasicBlock, UnetResBlock
    from monai.networks.blocks.segresnet_block import ResBlock
    from torch.utils.checkpoint import checkpoint

    count = 0
    for module in model.modules():
        if isinstance(module, ResidualUnit | ResBlock | UnetBasicBlock | UnetResBlock):
            plain = module.forward
            module.forward = lambda *a, _f=plain: checkpoint(_f, *a, use_reentrant=False)
            count += 1
    return count


def prepare(
    net: str,
    variant: str,
    patch: int,
    device: torch.device,
    width: float = 1.0,
    classes: int = 3,
    net_def: dict | None = None,
) -> tuple[nn.Module, Callable]:
    """The model for ``variant`` and the callable that runs its forward pass.

    ``net_def`` (a MONAI ``network_def`` mapping, as ``medseg plan`` writes) replaces the default
    network of ``net``."""
    torch.manual_seed(0)
    if net_def is not None:
        from medseg.models import build_network

        model = build_network(net_def).to(device).train()
    else:
        model = build_net(net, patch, width, classes).to(device).train()
    forward: Callable = model
    if variant == "fused":
        from medseg.kernels import optimize_memory

        optimize_memory(model)
    elif variant == "checkpoint":
        _checkpoint_blocks(model)
    elif variant == "compile":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = 0.5
        forward = torch.compile(model)
    elif variant != "baseline":
        raise ValueError(f"variant must be one of {VARIANTS}")
    return model, forward


def saved_bytes(forward: Callable, params: list[torch.Tensor], x: torch.Tensor) -> int:
    """Bytes of the unique non-parameter storages autograd keeps from forward for backward."""
    return saved_bytes_split(forward, params, x)[0]


def saved_bytes_split(
    forward: Callable, params: list[torch.Tensor], x: torch.Tensor, loss_fn: Callable | None = None, y=None
) -> tuple[int, int]:
    """(network, loss) saved bytes: storages first saved by the forward, then new ones saved by the loss."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
        net = sum(storages.values())
        loss = loss_fn(out, y) if loss_fn is not None else None
    total = sum(storages.values())
    del out, loss
    return net, total - net


def labels_like(
    batch: int, patch: int | tuple[int, int, int], classes: int, gen: torch.Generator
) -> torch.Tensor:
    """Float (N, 1, *patch) class maps of smooth random blobs (argmax of an upsampled noise field)."""
    shape = (patch,) * 3 if isinstance(patch, int) else tuple(patch)
    coarse = torch.randn(batch, classes, 4, 4, 4, generator=gen)
    coarse[:, 0] += 1.0  # a larger background, as in real volumes
    field = torch.nn.functional.interpolate(coarse, size=shape, mode="trilinear", align_corners=False)
    return field.argmax(1, keepdim=True).float()


def malloc_trim() -> None:
    """Return the C allocator's free memory to the OS (glibc); elsewhere nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


def status_kb(field: str) -> int:
    """A kB field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


class PhaseMeter:
    """High-water marks of successive phases of one step, each above the memory in use at its start."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peaks, self.start = device, {}, 0

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")

    def _high(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return status_kb("VmHWM") * 1024

    def begin(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.start = torch.cuda.memory_allocated()
        else:
            malloc_trim()
            self.start = status_kb("VmRSS") * 1024
        self._reset()

    def mark(self, phase: str) -> None:
        """Close ``phase`` (its peak is recorded) and start the next one."""
        self.peaks[phase] = self._high() - self.start
        self._reset()


def peak_step_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Memory one call of ``step`` needs above what was allocated before it (see module docstring)."""
    meter = PhaseMeter(device)
    meter.begin()
    step()
    meter.mark("step")
    return meter.peaks["step"]


def measure(
    net: str,
    variant: str,
    patch: int,
    batch: int,
    steps: int,
    device: torch.device,
    width: float = 1.0,
    classes: int = 3,
    net_def: dict | None = None,
    shape: tuple[int, int, int] | None = None,
    amp: bool = False,
) -> dict:
    """Saved bytes (network, loss), phase peaks and breakdown of the first timed step, median step_s.

    ``shape`` (a non-cubic patch) replaces ``patch``³; ``net_def`` replaces the default network;
    ``amp`` runs forward and loss under bfloat16 autocast, as ``medseg train`` does on CUDA (the
    timed steps and phase peaks; the saved-bytes count runs without it, in float32).
    ``static_bytes`` is what lives beside the step and is counted, not measured: weights and AdamW's
    two moment buffers (``12`` bytes per parameter) and the input batch with its labels."""
    shape = tuple(shape) if shape else (patch,) * 3
    model, forward = prepare(net, variant, patch, device, width, classes, net_def)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    loss_fn = _loss(variant, deep_supervision=bool(net_def and net_def.get("deep_supervision")))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, *shape, generator=gen).to(device)
    y = labels_like(batch, shape, classes, gen).to(device)
    # fused: the network's last convolution is fused with the loss where it can be (kernels/head.py)
    head_fused = variant == "fused" and model.__dict__.get("_medseg_head_module") is not None
    net_forward = _network_forward(model, forward, head_fused)
    step = _training_step(net_forward, loss_fn, opt, x, y, amp)

    for _ in range(2 if variant == "compile" else 1):  # warm-up: optimizer state, compilation
        step()
    meter = PhaseMeter(device)
    meter.begin()
    _timed(step, device, meter)  # phase marks cost a /proc read each; the medians come from unmarked steps
    phases = dict(meter.peaks)
    times, cpu_times = zip(*(_timed(step, device) for _ in range(steps)))
    opt.zero_grad(set_to_none=True)
    net_saved, loss_saved = saved_bytes_split(net_forward, params, x, loss_fn, y)
    grads = sum(p.numel() * p.element_size() for p in params)
    # the loss's gradient w.r.t. the logits: full size, or one slab's with a fused head
    logits = 0 if head_fused else batch * classes * x[0, 0].numel() * x.element_size()
    return {
        "saved_bytes": net_saved,
        "loss_saved_bytes": loss_saved,
        "peak_bytes": max(phases.values()),
        "phase_peaks": phases,
        "breakdown": peak_breakdown(phases, net_saved, loss_saved, grads, logits),
        "step_s": statistics.median(times),
        "step_cpu_s": statistics.median(cpu_times),
        "steps": steps,
        "amp": amp,
        "classes": classes,
        "head_fused": head_fused,
        "shape": list(shape),
        "batch": batch,
        "params": sum(p.numel() for p in params),
        "static_bytes": 12 * sum(p.numel() for p in params)
        + x.numel() * x.element_size()
        + y.numel() * y.element_size(),
    }


def _loss(variant: str, deep_supervision: bool = False) -> Callable:
    """The fused Dice+CE loss for ``fused``; MONAI's ``DiceCELoss`` for the other variants. With
    ``deep_supervision`` (a DynUNet that stacks its main output and heads on dim 1), MONAI's
    ``DeepSupervisionLoss`` over the unbound outputs, as ``medseg train`` computes it."""
    if variant == "fused":
        from medseg.kernels.loss import FusedDiceCELoss

        return FusedDiceCELoss()
    from monai.losses import DeepSupervisionLoss, DiceCELoss

    dice_ce = DiceCELoss(to_onehot_y=True, softmax=True)
    if not deep_supervision:
        return dice_ce
    stacked = DeepSupervisionLoss(dice_ce, weight_mode="exp")
    return lambda out, y: stacked(list(torch.unbind(out, dim=1)), y)


def _network_forward(model: nn.Module, forward: Callable, head_fused: bool) -> Callable:
    """``forward``, with the last convolution deferred to the loss when the head is fused."""
    from medseg.kernels.head import deferred_head

    if not head_fused:
        return forward

    def fused_forward(inp: torch.Tensor) -> torch.Tensor:
        with deferred_head(model):
            return forward(inp)

    return fused_forward


def _training_step(
    forward: Callable,
    loss_fn: Callable,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    amp: bool = False,
) -> Callable[..., None]:
    """One training step; with a :class:`PhaseMeter`, each phase's peak is marked as it ends."""

    def step(meter: PhaseMeter | None = None) -> None:
        mark = meter.mark if meter is not None else (lambda phase: None)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
            out = forward(x)
            mark("forward")
            loss = loss_fn(out, y)
        del out
        mark("loss")
        loss.backward()
        mark("backward")
        opt.step()
        mark("optimizer")

    return step


def _timed(
    step: Callable[..., None], device: torch.device, meter: PhaseMeter | None = None
) -> tuple[float, float]:
    """Wall and process CPU seconds (all threads: what the step costs, load or not) of one step."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    step(meter)
    sync()
    return time.perf_counter() - t0, time.process_time() - c0


def peak_breakdown(phases: dict[str, int], net_saved: int, loss_saved: int, grads: int, logits: int) -> dict:
    """The step's peak split into saved maps, the loss's transients, gradients and the remainder.

    ``logits`` is the loss's gradient w.r.t. the logits, alive at the start of backward (0 with a
    fused head); ``loss_transient`` what the loss needs while it runs beyond the maps kept for
    backward; the remainder is convolution workspace and allocator slack.
    """
    peak = max(phases.values())
    return {
        "peak_phase": max(phases, key=phases.get),
        "saved": net_saved + loss_saved,
        "loss_transient": max(phases["loss"] - net_saved - loss_saved, 0),
        "param_grads": grads,
        "logits_grad": logits,
        "workspace_and_allocator": max(peak - net_saved - loss_saved - grads - logits, 0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Measure one network variant's training step (one JSON line).")
    p.add_argument("--net", choices=NETS, required=True)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--patch", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--width", type=float, default=1.0, help="channel multiplier of the network")
    p.add_argument("--classes", type=int, default=3, help="output classes (labels drawn from all of them)")
    p.add_argument("--shape", type=int, nargs=3, help="a patch of this shape instead of --patch cubed")
    p.add_argument("--net-def", help="MONAI network_def as JSON, instead of --net's default network")
    p.add_argument("--amp", action="store_true", help="forward and loss under bfloat16 autocast")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(
        args.net,
        args.variant,
        args.patch,
        args.batch,
        args.steps,
        torch.device(args.device),
        args.width,
        args.classes,
        json.loads(args.net_def) if args.net_def else None,
        tuple(args.shape) if args.shape else None,
        args.amp,
    )
    if args.variant == "fused":
        from medseg.kernels.dispatch import backend_name

        result["backend"] = backend_name()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
