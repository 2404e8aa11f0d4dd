"""``optimize_memory``: rewrite a network's norm + activation pairs, in place, into fused blocks."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from monai.networks.blocks.dynunet_block import UnetBasicBlock, UnetResBlock, UnetUpBlock
from monai.networks.blocks.segresnet_block import ResBlock as SegResBlock
from monai.networks.layers.simplelayers import SkipConnection
from torch import nn

from medseg.kernels.blocks import (
    NORM_TYPES,
    FusedSegResBlock,
    FusedSequential,
    FusedUnetBasicBlock,
    FusedUnetResBlock,
    PartsConv,
    PartsSkip,
    PartsUnetUpBlock,
    describe,
    inner_conv,
    refresh_invertibility,
    splittable_conv,
)
from medseg.kernels.functions import NOT_INVERTIBLE, NormActSpec
from medseg.kernels.head import fuse_head
from medseg.kernels.slab import slice_narrow_convs

log = logging.getLogger(__name__)


@dataclass
class MemoryReport:
    """What ``optimize_memory`` converted (module path → fused form) and what it left alone, and why."""

    converted: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    replaced: dict[int, nn.Module] = field(default_factory=dict, repr=False)  # id(original) -> replacement
    sliced: list[str] = field(default_factory=list)  # narrow-input convolutions run in depth slabs
    head: str | None = None  # the head fused with the Dice+CE loss (kernels/head.py), or None
    head_reason: str = ""  # why the head is not fused

    def format(self) -> str:
        cats = sum(path.endswith(".cat") for path in self.converted)
        lines = [
            f"fused {len(self.converted) - cats} norm layers, split {cats} skip concatenations, "
            f"left {len(self.skipped)} norm layers unfused"
        ]
        lines += [f"  fused   {path}: {how}" for path, how in self.converted.items()]
        lines += [f"  skipped {path}: {why}" for path, why in self.skipped.items()]
        lines += [
            f"  slabs   {path}: narrow input, run in depth slabs (kernels/slab.py)" for path in self.sliced
        ]
        if self.head is not None:
            lines.append(
                f"  head    {self.head}: last convolution fused with the Dice+CE loss (kernels/head.py)"
            )
        else:
            lines.append(
                f"  head    not fused with the loss ({self.head_reason}); the fused loss takes the logits"
            )
        return "\n".join(lines)


def _is_identity(module: nn.Module) -> bool:
    """Children a fused step may pass over: identities and zero-probability dropout."""
    if isinstance(module, nn.Identity):
        return True
    return isinstance(module, nn.modules.dropout._DropoutNd) and module.p == 0


def _plan_sequential(seq: nn.Sequential, prefix: str, report: MemoryReport):
    """A fusion plan for ``seq`` (see ``FusedSequential``), or None when nothing fuses."""
    names = list(seq._modules)
    plan, specs, i = [], {}, 0
    while i < len(names):
        name, mod = names[i], seq._modules[names[i]]
        if not isinstance(mod, NORM_TYPES):
            plan.append(("module", name))
            i += 1
            continue
        j = i + 1
        while j < len(names) and _is_identity(seq._modules[names[j]]):
            j += 1
        act = seq._modules[names[j]] if j < len(names) else None
        spec = describe(mod, act) if act is not None else "not followed by an activation in its container"
        if isinstance(spec, str):
            report.skipped[prefix + name] = spec
            plan.append(("module", name))
            i += 1
            continue
        conv = inner_conv(seq._modules[names[j + 1]]) if j + 1 < len(names) else None
        if spec.act in NOT_INVERTIBLE and conv is None:
            report.skipped[prefix + name] = (
                f"{spec.act} is not inverted and no convolution follows to fuse with"
            )
            plan.append(("module", name))
            i += 1
            continue
        specs[name] = spec
        if spec.act in NOT_INVERTIBLE:
            plan.append(("norm_act_conv", name, names[j], names[j + 1]))
            report.converted[prefix + name] = (
                f"{spec.norm} norm + {spec.act} + conv (input kept, map rebuilt)"
            )
            i = j + 2
        else:
            plan.append(("norm_act", name, names[j]))
            report.converted[prefix + name] = f"{spec.norm} norm + {spec.act} (output kept, inverted)"
            i = j + 1
    return (plan, specs) if specs else None


def _pair(block: nn.Module, norm: str, act: str, prefix: str, report: MemoryReport) -> NormActSpec | None:
    spec = describe(getattr(block, norm), getattr(block, act))
    if isinstance(spec, str):
        report.skipped[prefix + norm] = spec
        return None
    return spec


def _convert_block(child: nn.Module, prefix: str, report: MemoryReport) -> nn.Module | None:
    """A fused replacement for a known MONAI block, or None."""
    if isinstance(child, SegResBlock):
        s1, s2 = _pair(child, "norm1", "act", prefix, report), _pair(child, "norm2", "act", prefix, report)
        if s1 and s2 and inner_conv(child.conv1) is not None and inner_conv(child.conv2) is not None:
            for n in ("norm1", "norm2"):
                report.converted[prefix + n] = f"{s1.norm} norm + {s1.act} + conv (input kept, map rebuilt)"
            return FusedSegResBlock(child, s1, s2)
    elif isinstance(child, UnetBasicBlock):
        s1, s2 = (
            _pair(child, "norm1", "lrelu", prefix, report),
            _pair(child, "norm2", "lrelu", prefix, report),
        )
        if s1 and s2 and s1.act not in NOT_INVERTIBLE:
            for n in ("norm1", "norm2"):
                report.converted[prefix + n] = f"{s1.norm} norm + {s1.act} (output kept, inverted)"
            return FusedUnetBasicBlock(child, s1, s2)
    elif isinstance(child, UnetResBlock):
        s1 = _pair(child, "norm1", "lrelu", prefix, report)
        if s1 and s1.act not in NOT_INVERTIBLE:
            report.converted[prefix + "norm1"] = f"{s1.norm} norm + {s1.act} (output kept, inverted)"
            report.skipped[prefix + "norm2"] = "a residual addition sits between norm and activation"
            s3 = None
            if hasattr(child, "norm3"):
                s3 = describe(child.norm3, None)
                report.converted[prefix + "norm3"] = f"{s3.norm} norm (output kept)"
            return FusedUnetResBlock(child, s1, s3)
    return None


def _to_parts(parent: nn.Module, name: str) -> None:
    setattr(parent, name, PartsConv(getattr(parent, name)))


def _split_skip(seq: nn.Module, prefix: str, report: MemoryReport) -> None:
    """UNet: ``SkipConnection(cat)`` followed by a convolution reads the two parts, not the cat."""
    names = list(seq._modules)
    for name, nxt in zip(names, names[1:]):
        skip, target = seq._modules[name], splittable_conv(seq._modules[nxt])
        if isinstance(skip, SkipConnection) and skip.mode == "cat" and skip.dim == 1 and target:
            _to_parts(*target)
            setattr(seq, name, PartsSkip(skip))
            report.converted[f"{prefix}{name}.cat"] = "skip concatenation read as parts by the next conv"


def _split_up_block(block: nn.Module, prefix: str, report: MemoryReport) -> nn.Module | None:
    """DynUNet: the up block's ``cat((up, skip))`` read as parts by its conv block's first convs."""
    conv_block = block.conv_block
    targets = [splittable_conv(conv_block.conv1)]
    if isinstance(conv_block, UnetResBlock | FusedUnetResBlock):
        targets.append(splittable_conv(conv_block.conv3) if hasattr(conv_block, "conv3") else None)
    elif not isinstance(conv_block, UnetBasicBlock | FusedUnetBasicBlock):
        return None
    if not all(targets):
        return None
    for target in targets:
        _to_parts(*target)
    report.converted[f"{prefix}cat"] = "skip concatenation read as parts by the next conv"
    return PartsUnetUpBlock(block)


def _convert(child: nn.Module, path: str, report: MemoryReport, inplace_first: bool) -> nn.Module:
    """``child`` converted (itself, modified inside, when no replacement is needed)."""
    fused = _convert_block(child, path, report)
    if fused is not None:
        return fused
    if isinstance(child, UnetUpBlock):
        _walk(child, path, report, inplace_first=False)
        return _split_up_block(child, path, report) or child
    # In MONAI's Convolution, the ADN's input is the conv output alone: it may be overwritten.
    _walk(child, path, report, inplace_first=type(child).__name__ == "Convolution")
    if isinstance(child, nn.Sequential):
        _split_skip(child, path, report)
        planned = _plan_sequential(child, path, report) if not isinstance(child, FusedSequential) else None
        if planned is not None:
            return FusedSequential(child, *planned, inplace_first=inplace_first)
    return child


def _walk(module: nn.Module, prefix: str, report: MemoryReport, inplace_first: bool) -> None:
    for name, child in list(module.named_children()):
        # A module reachable by two paths (DynUNet's skip layers hold its blocks) is converted once
        # and the same replacement is put at both places.
        if id(child) not in report.replaced:
            report.replaced[id(child)] = _convert(child, f"{prefix}{name}.", report, inplace_first)
        setattr(module, name, report.replaced[id(child)])


def optimize_memory(model: nn.Module) -> MemoryReport:
    """Rewrite ``model`` in place so that its norm + activation pairs keep fewer feature maps.

    Converted: MONAI ``UNet`` (ADN blocks), ``SegResNet`` (``ResBlock`` and the final
    norm-act-conv), ``DynUNet`` (``UnetBasicBlock``/``UnetResBlock``), and any ``nn.Sequential`` with a
    norm directly followed by a supported activation. Convolutions with at most 4 input channels
    (the network's first) run in depth slabs on CPU (``slab.py``). The network's last convolution is
    made ready to be fused with the Dice+CE loss where it can be (``head.py``; it acts only inside
    ``deferred_head(model)``, which training enters). Parameter names, and so state_dicts,
    checkpoints and exported bundles, are unchanged. Every norm layer appears in the report, either
    as converted or as skipped with the reason.
    """
    report = MemoryReport()
    _walk(model, "", report, inplace_first=False)
    report.sliced = slice_narrow_convs(model)
    report.head, report.head_reason = fuse_head(model)
    if report.converted and not getattr(model, "_medseg_refresh_hook", None):
        # one device-to-host transfer per forward for all layers' invertibility, not one per layer
        model.__dict__["_medseg_refresh_hook"] = model.register_forward_pre_hook(refresh_invertibility)
    seen = set(report.converted) | set(report.skipped)
    for name, mod in model.named_modules():
        if isinstance(mod, NORM_TYPES) and name not in seen:
            report.skipped[name] = "not directly followed by an activation"
    log.info("optimize_memory: %s", report.format().splitlines()[0])
    return report
