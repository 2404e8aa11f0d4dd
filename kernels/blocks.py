"""Fused stand-ins for MONAI blocks that keep the original children (and state_dict keys).

Each fused block holds the very modules of the block it replaces, under the same names, so
parameters, optimizer state, checkpoints and exported bundles are unchanged; only ``forward``
differs, calling :mod:`medseg.kernels.functions` with those modules' parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medseg.kernels.functions import (
    ConvSpec,
    FusedNormAct,
    FusedNormActConv,
    NormActSpec,
    invertibility,
    param_versions,
)

_INSTANCE = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
_BATCH = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
NORM_TYPES = (*_INSTANCE, *_BATCH, nn.GroupNorm)


def describe(norm: nn.Module, act: nn.Module | None) -> NormActSpec | str:
    """The fused spec of ``norm`` followed by ``act`` (None = identity), or why they cannot fuse."""
    if isinstance(norm, _INSTANCE):
        if norm.track_running_stats:
            return "instance norm with running statistics is not supported"
        kind, groups = "instance", 1
    elif isinstance(norm, nn.GroupNorm):
        kind, groups = "group", norm.num_groups
    elif isinstance(norm, _BATCH):
        kind, groups = "batch", 1
    else:
        return f"{type(norm).__name__} is not a supported norm"
    momentum = getattr(norm, "momentum", None)
    if act is None:
        return NormActSpec(kind, "identity", groups, norm.eps, 0.0, momentum)
    if isinstance(act, nn.ReLU):
        return NormActSpec(kind, "relu", groups, norm.eps, 0.0, momentum)
    if isinstance(act, nn.LeakyReLU):
        return NormActSpec(kind, "leaky_relu", groups, norm.eps, float(act.negative_slope), momentum)
    if isinstance(act, nn.PReLU):
        return NormActSpec(kind, "prelu", groups, norm.eps, 0.0, momentum)
    if isinstance(act, nn.ELU):
        return NormActSpec(kind, "elu", groups, norm.eps, float(act.alpha), momentum)
    return f"activation {type(act).__name__} is not supported (ReLU, LeakyReLU, PReLU, ELU)"


def _norm_tensors(norm: nn.Module) -> tuple:
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    if isinstance(norm, _BATCH) and norm.track_running_stats:
        return weight, bias, norm.running_mean, norm.running_var, norm.num_batches_tracked
    return weight, bias, None, None, None


def _uses_batch_stats(norm: nn.Module) -> bool:
    return norm.training or not getattr(norm, "track_running_stats", False)


def norm_act(x: torch.Tensor, norm: nn.Module, act: nn.Module | None, spec: NormActSpec, inplace: bool):
    """``act(norm(x))`` through :class:`FusedNormAct`; ``inplace`` only when x has no other reader."""
    weight, bias, rmean, rvar, nbt = _norm_tensors(norm)
    prelu = act.weight if isinstance(act, nn.PReLU) else None
    training = _uses_batch_stats(norm)
    # Register the site for refresh_invertibility() (in __dict__: act must not become a child module),
    # and use its decision while the parameters are the ones it was made for.
    norm.__dict__["_medseg_site"] = (act, spec)
    cached = norm.__dict__.get("_medseg_invertible")
    invertible = cached[1] if cached and cached[0] == param_versions(weight, bias, prelu) else None
    return FusedNormAct.apply(x, weight, bias, prelu, rmean, rvar, nbt, spec, training, inplace, invertible)


def refresh_invertibility(model: nn.Module, _args: object = None) -> None:
    """Decide every fused layer's "keep the output and invert it" in one device-to-host transfer.

    A forward pre-hook of converted models (``optimize_memory``): without it each fused layer reads
    its parameters' signs and magnitudes on the host, one CUDA sync per layer per step. Layers are
    known from their first call, so the first step still decides per layer. A decision is used only
    while the parameters' version counters are unchanged (an optimizer step invalidates it).
    """
    if not torch.is_grad_enabled():
        return
    sites, norms = [], []
    for module in model.modules():
        site = module.__dict__.get("_medseg_site")
        if site is None:
            continue
        act, spec = site
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        prelu = act.weight if isinstance(act, nn.PReLU) else None
        sites.append((spec, weight, bias, prelu))
        norms.append((module, param_versions(weight, bias, prelu)))
    for (module, versions), flag in zip(norms, invertibility(sites)):
        module.__dict__["_medseg_invertible"] = (versions, flag)


def inner_conv(module: nn.Module) -> nn.Module | None:
    """The plain zero-padded convolution in ``module`` (MONAI's conv-only ``Convolution`` wraps one)."""
    if isinstance(module, nn.Sequential) and len(module) == 1:
        module = module[0]
    if isinstance(module, _CONV) and module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return module
    return None


def norm_act_conv(
    x: torch.Tensor, norm: nn.Module, act: nn.Module | None, conv: nn.Module, spec: NormActSpec
):
    """``conv(act(norm(x)))`` through :class:`FusedNormActConv` (only x is kept for backward)."""
    weight, bias, rmean, rvar, nbt = _norm_tensors(norm)
    prelu = act.weight if isinstance(act, nn.PReLU) else None
    cspec = ConvSpec(tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), conv.groups)
    return FusedNormActConv.apply(
        x, weight, bias, prelu, conv.weight, conv.bias, rmean, rvar, nbt, spec, cspec, _uses_batch_stats(norm)
    )


def _fresh_output(seq: nn.Module, step: tuple) -> bool:
    """Whether ``step`` of a plan returns a new tensor that only the next step reads."""
    if step[0] == "norm_act_conv":
        return True
    if step[0] != "module":
        return False
    module = seq._modules[step[1]]
    if isinstance(module, nn.Sequential) and len(module) == 1:  # MONAI's conv-only Convolution
        module = module[0]
    return isinstance(module, nn.modules.conv._ConvNd | PartsConv)


class FusedSequential(nn.Sequential):
    """An ``nn.Sequential`` (MONAI's ``ADN`` and ``Convolution`` are ones) run through a fusion plan.

    ``plan`` is a list of steps over the child names: ``("module", a)``, ``("norm_act", n, a)`` or
    ``("norm_act_conv", n, a, c)``; children skipped by the plan (a zero-probability dropout) are
    identities in training and evaluation alike.
    """

    def __init__(
        self, source: nn.Sequential, plan: list[tuple], specs: dict[str, NormActSpec], inplace_first: bool
    ):
        super().__init__()
        for name, child in source.named_children():
            self.add_module(name, child)
        self.plan, self.specs = plan, specs
        # A norm may overwrite its input only when that is a fresh convolution output that nothing
        # else reads: not after an identity, an eval-mode dropout or a reshape (they hand on their
        # input), nor after another fused pair (which kept its output for backward).
        self.inplace = [
            inplace_first if i == 0 else _fresh_output(self, plan[i - 1]) for i in range(len(plan))
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, step in enumerate(self.plan):
            kind, names = step[0], step[1:]
            mods = [self._modules[n] if n is not None else None for n in names]
            if kind == "module":
                x = mods[0](x)
            elif kind == "norm_act":
                x = norm_act(x, mods[0], mods[1], self.specs[names[0]], inplace=self.inplace[i])
            else:
                x = norm_act_conv(x, mods[0], mods[1], inner_conv(mods[2]), self.specs[names[0]])
        return x


class FusedSegResBlock(nn.Module):
    """MONAI ``SegResNet`` ``ResBlock``: ``x + conv2(act(norm2(conv1(act(norm1(x))))))``.

    Both norm + activation + conv triples run as :class:`FusedNormActConv`, so the block keeps its
    input and the first conv's output (2 maps) instead of also both activated maps (4 maps).
    """

    def __init__(self, block: nn.Module, spec1: NormActSpec, spec2: NormActSpec):
        super().__init__()
        for name in ("norm1", "norm2", "act", "conv1", "conv2"):
            self.add_module(name, getattr(block, name))
        self.spec1, self.spec2 = spec1, spec2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = norm_act_conv(x, self.norm1, self.act, inner_conv(self.conv1), self.spec1)
        out = norm_act_conv(out, self.norm2, self.act, inner_conv(self.conv2), self.spec2)
        out += x  # the conv output is ours alone
        return out


class FusedUnetBasicBlock(nn.Module):
    """MONAI ``DynUNet`` ``UnetBasicBlock``: two conv → norm → LeakyReLU, each norm+act fused in place."""

    def __init__(self, block: nn.Module, spec1: NormActSpec, spec2: NormActSpec):
        super().__init__()
        for name in ("conv1", "conv2", "lrelu", "norm1", "norm2"):
            self.add_module(name, getattr(block, name))
        self.spec1, self.spec2 = spec1, spec2

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        out = norm_act(self.conv1(inp), self.norm1, self.lrelu, self.spec1, inplace=True)
        return norm_act(self.conv2(out), self.norm2, self.lrelu, self.spec2, inplace=True)


class FusedUnetResBlock(nn.Module):
    """MONAI ``DynUNet`` ``UnetResBlock``: conv → norm → LeakyReLU fused; the residual tail unfused.

    ``lrelu(norm2(conv2(·)) + residual)`` has an addition between norm and activation, so it stays
    as MONAI computes it; its projection norm (``norm3``) saves its output instead of its input.
    """

    def __init__(self, block: nn.Module, spec1: NormActSpec, spec3: NormActSpec | None):
        super().__init__()
        for name, child in block.named_children():
            self.add_module(name, child)
        self.spec1, self.spec3 = spec1, spec3

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        out = norm_act(self.conv1(inp), self.norm1, self.lrelu, self.spec1, inplace=True)
        out = self.norm2(self.conv2(out))
        residual = inp
        if hasattr(self, "conv3"):
            residual = self.conv3(residual)
        if hasattr(self, "norm3"):
            residual = norm_act(residual, self.norm3, None, self.spec3, inplace=hasattr(self, "conv3"))
        return self.lrelu(out + residual)


class _CatConvFn(torch.autograd.Function):
    """``conv(cat(a, b), W, β)`` that saves ``a`` and ``b``, not the concatenation (rebuilt in backward).

    backward: ``(∂x, ∂W, ∂β) = convolution_backward(∂y, cat(a, b), W)``, ``∂a, ∂b = split(∂x)``.
    """

    @staticmethod
    def forward(ctx, a, b, weight, bias, parts):
        with torch.no_grad():
            out = parts._conv(torch.cat((a, b), 1), weight, bias)
        ctx.save_for_backward(a, b, weight)
        ctx.parts, ctx.has_bias = parts, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, weight = ctx.saved_tensors
        p = ctx.parts
        need = [ctx.needs_input_grad[0] or ctx.needs_input_grad[1], ctx.needs_input_grad[2], False]
        x = torch.cat((a, b), 1)
        gx, gw, _ = torch.ops.aten.convolution_backward(
            grad.contiguous(), x, weight, None, list(p.stride), list(p.padding), list(p.dilation),
            p.transposed, list(p.output_padding) if p.transposed else [0] * p.dims, 1, need,
        )  # fmt: skip
        del x
        ga, gb = gx.split([a.shape[1], b.shape[1]], 1) if gx is not None else (None, None)
        gbias = grad.sum([0, *range(2, grad.dim())]) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return ga, gb, gw, gbias, None


class PartsConv(nn.Module):
    """A convolution that also takes its input as channel parts ``(a, b)`` instead of ``cat(a, b)``.

    ``conv(cat(a, b), W) = conv(a, W_a) + conv(b, W_b)`` with ``W`` split along its input channels,
    so the concatenated map is never built: autograd keeps ``a`` and ``b``, and ``a`` (a skip
    connection) is kept by the encoder's own convolution anyway. That sum needs two outputs at once;
    where the output is larger than the concatenated input (UNet's upsampling transposed
    convolutions: 8x the voxels), :class:`_CatConvFn` convolves a transient ``cat(a, b)`` instead,
    still saving only ``a`` and ``b``. Holds the original parameters under the original names
    (``weight``, ``bias``).
    """

    def _out_bytes(self, x: torch.Tensor) -> int:
        k = self.weight.shape[2:]
        cout = self.weight.shape[1] if self.transposed else self.weight.shape[0]
        size = cout * x.shape[0] * x.element_size()
        op = (
            self.output_padding
            if isinstance(self.output_padding, tuple)
            else (self.output_padding,) * self.dims
        )
        for i, n in enumerate(x.shape[2:]):
            s, p, d = self.stride[i], self.padding[i], self.dilation[i]
            if self.transposed:
                size *= (n - 1) * s - 2 * p + d * (k[i] - 1) + op[i] + 1
            else:
                size *= (n + 2 * p - d * (k[i] - 1) - 1) // s + 1
        return size

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.transposed = isinstance(conv, nn.modules.conv._ConvTransposeNd)
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.output_padding = getattr(conv, "output_padding", 0)
        self.dims = len(conv.kernel_size)

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.transposed:
            fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.dims - 1]
            return fn(x, weight, bias, self.stride, self.padding, self.output_padding, 1, self.dilation)
        fn = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
        return fn(x, weight, bias, self.stride, self.padding, self.dilation, 1)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if not isinstance(x, tuple):
            return self._conv(x, self.weight, self.bias)
        a, b = x
        if (a.numel() + b.numel()) * a.element_size() < self._out_bytes(a) and a.dim() == self.dims + 2:
            return _CatConvFn.apply(a, b, self.weight, self.bias, self)
        ca = a.shape[1]
        # Input channels are dim 1 of a convolution's weight and dim 0 of a transposed one's.
        w_a, w_b = (
            (self.weight[:ca], self.weight[ca:])
            if self.transposed
            else (self.weight[:, :ca], self.weight[:, ca:])
        )
        out = self._conv(b, w_b, self.bias)
        out += self._conv(a, w_a, None)
        return out


def splittable_conv(module: nn.Module) -> tuple[nn.Module, str] | None:
    """(parent, name) of the convolution that first reads ``module``'s input through Sequentials only."""
    parent = None
    name = ""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        parent, name = module, next(iter(module._modules))
        module = module._modules[name]
    ok = isinstance(module, (*_CONV, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d))
    ok = ok and module.groups == 1 and module.padding_mode == "zeros" and not isinstance(module.padding, str)
    return (parent, name) if ok and parent is not None else None


class PartsSkip(nn.Module):
    """MONAI ``SkipConnection`` (cat on channels) that hands on ``(x, submodule(x))`` unconcatenated."""

    def __init__(self, skip: nn.Module):
        super().__init__()
        self.submodule = skip.submodule

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.submodule(x)


class PartsUnetUpBlock(nn.Module):
    """MONAI ``DynUNet`` ``UnetUpBlock`` whose ``cat((up, skip))`` goes to its conv block as parts."""

    def __init__(self, block: nn.Module):
        super().__init__()
        for name, child in block.named_children():
            self.add_module(name, child)

    def forward(self, inp: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv_block((self.transp_conv(inp), skip))
