"""Autograd functions for fused normalisation + activation (the thin layer over ``dispatch``).

Two functions, chosen per call by whether the activation can be inverted:

``FusedNormAct`` (In-Place ABN's method, extended to Instance and Group norm)
    forward  ``z = act(γ (x − μ) σ⁻¹ + β)``, written over ``x`` when the caller says ``x`` has no
             other reader; saves **only z** and per-group ``μ, σ⁻¹`` (plus the small parameters).
             The next convolution saves the same z, so the pair keeps one map instead of three
             (conv output, norm output, activation output).
    backward ``y = act⁻¹(z)``, ``x̂ = (y − β)/γ``, then the norm backward (reference.py). dx is
             written over z's storage: z is dead by then, because every consumer of z has already
             run its backward (Layrub's reuse of dead activation buffers). A second backward
             through a retained graph therefore fails loudly with PyTorch's in-place error, and
             a caller must not read z itself after backward (a network's own output never is
             one: MONAI's nets end in a convolution).
    Falls back to saving the input (and recomputing) when the activation is ReLU, or when an
    inverse would be ill-conditioned (``|γ|`` tiny against ``|β|``, a PReLU slope ≤ 0).

``FusedNormActConv`` for activations that cannot be inverted (ReLU: SegResNet's default; ELU,
whose inverse is ill-conditioned in float32)
    forward  ``out = conv(act(norm(x)))``; saves **only x** (the norm's input) and ``μ, σ⁻¹``:
             the activated map is freed right after the convolution has consumed it.
    backward rebuilds ``z = act(norm(x))`` from x and the saved statistics (cheap, element-wise),
             gets ``dz, dW, db`` from ``aten.convolution_backward``, frees z, and runs the norm
             backward from the input with dx written over dz's buffer. The ReLU mask is
             recomputed from x, so no mask or map is kept between forward and backward.
    layout   on CPU, when the convolution reads fewer than 16 channels, the rebuilt map (and in
             backward the output gradient) is convolved in channels-last layout: oneDNN would
             otherwise copy it into a block padded to 16 channels (docs/design.md). The output and
             the gradients handed back are plain contiguous tensors; the values are the same maths.

Both are exact: same maths as the unfused PyTorch modules up to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from medseg.kernels.dispatch import ACT_CODES, NORM_CODES, ops_for

# Backward writes dx over the dead saved output (Layrub); ``replayable_backward`` turns this off.
_REUSE_DEAD_BUFFERS = True

# The inverse x̂ = (y − β)/γ loses about log10(|β|/|γ|) digits; beyond this ratio keep the input.
_MAX_BIAS_RATIO = 100.0


@dataclass(frozen=True)
class NormActSpec:
    """Static description of one fused layer (everything that is not a tensor)."""

    norm: str  # instance | group | batch
    act: str  # identity | relu | leaky_relu | prelu | elu
    num_groups: int = 1
    eps: float = 1e-5
    param: float = 0.0  # leaky slope or ELU alpha
    momentum: float | None = 0.1  # batch norm running statistics

    @property
    def codes(self) -> tuple[int, int]:
        return NORM_CODES[self.norm], ACT_CODES[self.act]


@contextmanager
def replayable_backward() -> Iterator[None]:
    """Within this block, fused layers keep their saved output intact through backward.

    Needed only to run backward more than once through one graph (``retain_graph=True``,
    ``gradcheck``); otherwise the second backward raises PyTorch's in-place modification error.
    """
    global _REUSE_DEAD_BUFFERS
    previous, _REUSE_DEAD_BUFFERS = _REUSE_DEAD_BUFFERS, False
    try:
        yield
    finally:
        _REUSE_DEAD_BUFFERS = previous


# ELU's inverse log1p(z/α) loses float32 precision like e^(−y) and saturates to −inf once z rounds
# to −α (y ≲ −17): one dark outlier would make a whole group's gradient NaN. ELU keeps its input.
NOT_INVERTIBLE = ("relu", "elu")


def _invertible_on_device(spec: NormActSpec, weight, bias, prelu) -> torch.Tensor | bool:
    """Whether the inverse is well conditioned: a 0-d bool tensor on the parameters' device, or a bool."""
    if spec.act in NOT_INVERTIBLE or (spec.act == "leaky_relu" and spec.param <= 0):
        return False
    ok: torch.Tensor | bool = True
    if spec.act == "prelu":
        ok = (prelu.detach() > 0).all()
    if weight is not None:
        smallest = weight.detach().abs().min()
        largest_bias = bias.detach().abs().max() if bias is not None else weight.new_zeros(())
        ok = ok & (smallest != 0) & (largest_bias <= _MAX_BIAS_RATIO * smallest)
    return ok


def _invertible(spec: NormActSpec, weight, bias, prelu) -> bool:
    """One layer's decision; on CUDA this reads a device value (a sync): see invertibility()."""
    return bool(_invertible_on_device(spec, weight, bias, prelu))


def param_versions(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    """Version counters of the parameters a decision depends on (an optimizer step bumps them)."""
    return tuple(-1 if t is None else t._version for t in tensors)


def invertibility(
    sites: list[tuple[NormActSpec, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]],
) -> list[bool]:
    """:func:`_invertible` for many layers with one device-to-host transfer instead of one per layer."""
    decided = [_invertible_on_device(*site) for site in sites]
    pending = [d for d in decided if isinstance(d, torch.Tensor)]
    values = iter(torch.stack(pending).tolist()) if pending else iter(())
    return [bool(next(values)) if isinstance(d, torch.Tensor) else d for d in decided]


def _statistics(x, spec, training, running_mean, running_var, num_batches):
    """Per-group (μ, σ⁻¹) and whether they depend on x; updates batch-norm running stats in training."""
    norm, _ = spec.codes
    ops = ops_for(x)
    if spec.norm == "batch" and not training and running_mean is not None:
        return running_mean.to(x.dtype), torch.rsqrt(running_var.to(x.dtype) + spec.eps), False
    mean, invstd = ops.norm_stats(x, norm, spec.num_groups, spec.eps)
    if spec.norm == "batch" and training and running_mean is not None:
        with torch.no_grad():
            n = x.numel() // x.shape[1]
            var = (invstd.double().pow(-2) - spec.eps) * n / max(n - 1, 1)
            if num_batches is not None:
                num_batches.add_(1)
            factor = spec.momentum if spec.momentum is not None else 1.0 / float(num_batches)
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(var.to(running_var.dtype), alpha=factor)
    return mean, invstd, True


def _act_grads(ctx, dweight, dbias, dprelu):
    return (
        dweight if ctx.needs_input_grad[1] else None,
        dbias if ctx.needs_input_grad[2] else None,
        dprelu if ctx.needs_input_grad[3] else None,
    )


class FusedNormAct(torch.autograd.Function):
    """``z = act(norm(x))`` saving z (invertible activation) or x (otherwise); see module docstring."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(
        ctx, x, weight, bias, prelu, running_mean, running_var, num_batches, spec, training, inplace,
        invertible=None,
    ):  # fmt: skip
        inplace = inplace and x.is_contiguous()
        x = x.contiguous()
        mean, invstd, stats_grad = _statistics(x, spec, training, running_mean, running_var, num_batches)
        # ``invertible``: decided beforehand for the whole model in one transfer (blocks.py); else here.
        from_output = _invertible(spec, weight, bias, prelu) if invertible is None else invertible
        norm, act = spec.codes
        out = x if (inplace and from_output) else torch.empty_like(x)
        ops_for(x).forward(x, mean, invstd, weight, bias, norm, spec.num_groups, act, spec.param, prelu, out)
        if out is x:
            ctx.mark_dirty(x)
        ctx.save_for_backward(out if from_output else x, mean, invstd, weight, bias, prelu)
        ctx.spec, ctx.from_output, ctx.stats_grad = spec, from_output, stats_grad
        ctx.reuse = from_output and _REUSE_DEAD_BUFFERS
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        saved, mean, invstd, weight, bias, prelu = ctx.saved_tensors
        spec = ctx.spec
        norm, act = spec.codes
        grad_out = grad_out.contiguous()
        # The saved output is dead once its consumers ran their backward: write dx over it, and bump
        # its version so that a replay through a retained graph fails instead of reading dx.
        grad_in = saved if ctx.reuse else torch.empty_like(saved)
        dweight, dbias, dprelu = ops_for(saved).backward(
            saved, grad_out, mean, invstd, weight, bias, norm, spec.num_groups, act, spec.param, prelu,
            ctx.from_output, ctx.stats_grad, grad_in,
        )  # fmt: skip
        if ctx.reuse:
            torch.autograd.graph.increment_version(grad_in)
        return (grad_in if ctx.needs_input_grad[0] else None, *_act_grads(ctx, dweight, dbias, dprelu)) + (
            None,
        ) * 7


@dataclass(frozen=True)
class ConvSpec:
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def run(self, z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[z.dim()]
        return conv(z, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class FusedNormActConv(torch.autograd.Function):
    """``conv(act(norm(x)))`` saving only x; the activated map is rebuilt in backward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(
        ctx, x, weight, bias, prelu, conv_weight, conv_bias, running_mean, running_var, num_batches, spec, conv,
        training,
    ):  # fmt: skip
        x = x.contiguous()
        mean, invstd, stats_grad = _statistics(x, spec, training, running_mean, running_var, num_batches)
        z = _rebuild(x, mean, invstd, weight, bias, prelu, spec)
        if channels_last(z, conv_weight):
            # oneDNN's blocked copy of a narrow z would be padded to 16 channels: convolve channels-last.
            z = _to_channels_last(z)
            out = conv.run(z, conv_weight.contiguous(memory_format=_CL), conv_bias)
            del z
            out = out.contiguous()
        else:
            out = conv.run(z, conv_weight, conv_bias)
            del z
        ctx.save_for_backward(x, mean, invstd, weight, bias, prelu, conv_weight)
        ctx.spec, ctx.conv, ctx.stats_grad, ctx.has_conv_bias = spec, conv, stats_grad, conv_bias is not None
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        x, mean, invstd, weight, bias, prelu, conv_weight = ctx.saved_tensors
        spec, conv = ctx.spec, ctx.conv
        norm, act = spec.codes
        # Weight gradient first, then free the rebuilt map before the input gradient is allocated:
        # backward then holds x, grad_out and one more map, like an unfused conv's backward.
        bias_sizes = [conv_weight.shape[0]] if ctx.has_conv_bias else None
        args = (
            list(conv.stride),
            list(conv.padding),
            list(conv.dilation),
            False,
            [0] * (x.dim() - 2),
            conv.groups,
        )
        z = _rebuild(x, mean, invstd, weight, bias, prelu, spec)
        cl = channels_last(z, conv_weight)
        if cl:  # as in forward: no padded blocked copies of z, grad_out or grad_z
            z = _to_channels_last(z)
            grad_out = grad_out.contiguous(memory_format=_CL)
            conv_weight = conv_weight.contiguous(memory_format=_CL)
        else:
            grad_out = grad_out.contiguous()
        _, grad_cw, grad_cb = torch.ops.aten.convolution_backward(
            grad_out, z, conv_weight, bias_sizes, *args,
            [False, ctx.needs_input_grad[4], ctx.has_conv_bias and ctx.needs_input_grad[5]],
        )  # fmt: skip
        # The input gradient reads only the input's shape (z's), not the map itself.
        shape_only = z if cl else x
        del z
        grad_z = torch.ops.aten.convolution_backward(
            grad_out, shape_only, conv_weight, None, *args, [True, False, False]
        )[0]
        del grad_out, shape_only
        grad_z = grad_z.contiguous()
        if grad_cw is not None:
            grad_cw = grad_cw.contiguous()
        # grad_z is ours alone: the norm backward writes dx over it.
        dweight, dbias, dprelu = ops_for(x).backward(
            x, grad_z, mean, invstd, weight, bias, norm, spec.num_groups, act, spec.param, prelu,
            False, ctx.stats_grad, grad_z,
        )  # fmt: skip
        return (
            grad_z if ctx.needs_input_grad[0] else None,
            *_act_grads(ctx, dweight, dbias, dprelu),
            grad_cw,
            grad_cb,
            *(None,) * 6,
        )


_CL = torch.channels_last_3d
# oneDNN on x86 convolves in blocks of 16 channels (AVX-512; 8 on AVX2): a plain-layout input with
# fewer channels is copied into a padded blocked buffer (2x the map for 8 channels, in forward and
# again for z, grad_out and grad_z in backward), and its 8-channel kernels ran 6x slower than the
# channels-last ones here (docs/design.md). Channels-last inputs are convolved without that copy.
CL_MAX_CHANNELS = 15


def channels_last(z: torch.Tensor, conv_weight: torch.Tensor) -> bool:
    """Whether the fused conv runs channels-last: a 3D CPU convolution with a narrow (< 16) input."""
    return z.dim() == 5 and z.device.type == "cpu" and conv_weight.shape[1] <= CL_MAX_CHANNELS


def _to_channels_last(z: torch.Tensor) -> torch.Tensor:
    """``z`` in channels-last layout; the plain copy is freed on return (the caller holds no other)."""
    return z.contiguous(memory_format=_CL)


def _rebuild(x, mean, invstd, weight, bias, prelu, spec) -> torch.Tensor:
    norm, act = spec.codes
    z = torch.empty_like(x)
    ops_for(x).forward(x, mean, invstd, weight, bias, norm, spec.num_groups, act, spec.param, prelu, z)
    return z
