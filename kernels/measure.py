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
  parameters excluded. Exact, but not the peak: backward's own buffers come on top.
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


def build_net(net: str, patch: int, width: float = 1.0) -> nn.Module:
    """The network medseg trains for ``net`` (its default config), 1 input channel, 3 classes.

    ``width`` scales every layer's channel count (the quick benchmark uses 0.5).
    """
    from medseg.config import config_from_dict
    from medseg.models import build_network, network_def

    model = {"name": net, "norm": "group" if net == "segresnet" else "instance"}
    cfg = config_from_dict({"model": model, "transforms": {"patch": [patch] * 3, "spacing": [1.5] * 3}})
    cfg.model.channels = [max(int(c * width), 4) for c in cfg.model.channels]
    cfg.model.init_filters = max(int(cfg.model.init_filters * width), 8)
    net_def = network_def(cfg, out_channels=3)
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
    net: str, variant: str, patch: int, device: torch.device, width: float = 1.0
) -> tuple[nn.Module, Callable]:
    """The model for ``variant`` and the callable that runs its forward pass."""
    torch.manual_seed(0)
    model = build_net(net, patch, width).to(device).train()
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
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
    total = sum(storages.values())
    del out
    return total


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def peak_step_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Memory one call of ``step`` needs above what was allocated before it (see module docstring)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    _malloc_trim()
    Path("/proc/self/clear_refs").write_text("5")
    start = _status_kb("VmRSS")
    step()
    return (_status_kb("VmHWM") - start) * 1024


def measure(
    net: str, variant: str, patch: int, batch: int, steps: int, device: torch.device, width: float = 1.0
) -> dict:
    """saved_bytes, peak_bytes (of the first timed step) and median step_s of ``steps`` steps after warm-up."""
    from monai.losses import DiceCELoss

    model, forward = prepare(net, variant, patch, device, width)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, patch, patch, patch, generator=gen).to(device)
    y = torch.randint(0, 3, (batch, 1, patch, patch, patch), generator=gen).to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2 if variant == "compile" else 1):  # warm-up: optimizer state, compilation
        step()
    times: list[float] = []

    def timed_step() -> None:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)

    peak = peak_step_bytes(timed_step, device)
    for _ in range(steps - 1):
        timed_step()
    opt.zero_grad(set_to_none=True)
    saved = saved_bytes(forward, params, x)
    return {"saved_bytes": saved, "peak_bytes": peak, "step_s": statistics.median(times), "steps": steps}


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
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(
        args.net, args.variant, args.patch, args.batch, args.steps, torch.device(args.device), args.width
    )
    if args.variant == "fused":
        from medseg.kernels.dispatch import backend_name

        result["backend"] = backend_name()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
