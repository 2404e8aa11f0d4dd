"""Narrow-input 3D convolutions run in depth slabs, so oneDNN's blocked copy of the input stays small.

Why (measured, docs/design.md): oneDNN convolves in a blocked channel layout, 16 channels per
block on AVX-512 CPUs and 8 on AVX2, so a 1-channel input image is copied into a 16- (or 8-)
channel buffer before the first convolution, in forward and again in backward (and its input
gradient is produced in that padded layout too: the last 3-channel convolution of a UNet). For a
batch of two 64³ images that copy is 33.5 MB on AVX-512 (16.8 MB on AVX2) for a 2 MB input: most of
the step's peak outside saved tensors, and the reason the same step peaks higher on AVX-512 machines.

:class:`SlabConv` computes ``conv(x)`` as ``K`` depth slabs of the output, each from its slab of
the zero-padded input (kernel halo included), so only one slab's blocked copy exists at a time:

    forward   y[:, :, d0:d1] = conv(pad(x)[:, :, d0·s : (d1−1)·s + dil·(k−1) + 1], W, b), padding 0
    backward  per slab, ``convolution_backward`` of the output slab against its input slab:
              ∂W = Σ_slabs ∂W(slab), ∂pad(x)[slab rows] += ∂x(slab) (slabs overlap by the halo),
              ∂x = the padded gradient cropped;  ∂b = Σ ∂y over (N, spatial)

Exact up to the order of the weight-gradient sum. Saves x (the network's input, held by the caller
anyway), not the padded copy. Used by ``optimize_memory`` for convolutions with at most 4 input
channels, no groups and numeric zero padding; ``SlabConv`` is swapped in as the module's class, so
parameter names are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_IN_CHANNELS = 4  # padded to a 16-channel block: 4x or more; wider inputs lose more to the copy
SLAB_VOXELS = 2**15  # output voxels (batch included) per slab at least; at most MAX_SLABS slabs
MAX_SLABS = 4


def _slabs(depth_out: int, plane: int, batch: int) -> list[tuple[int, int]]:
    count = max(1, min(MAX_SLABS, depth_out // 2, (depth_out * plane * batch) // SLAB_VOXELS))
    step = -(-depth_out // count)
    return [(d, min(d + step, depth_out)) for d in range(0, depth_out, step)]


class _SlabConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation):
        k, s, dil = weight.shape[2], stride[0], dilation[0]
        pads = [p for pad in reversed(padding) for p in (pad, pad)]
        xp = F.pad(x, pads)
        depth_out = (xp.shape[2] - dil * (k - 1) - 1) // s + 1
        out = None
        for d0, d1 in _slabs(depth_out, xp.shape[3] * xp.shape[4], x.shape[0]):
            part = F.conv3d(
                xp[:, :, d0 * s : (d1 - 1) * s + dil * (k - 1) + 1], weight, bias, stride, 0, dilation
            )
            if out is None:
                out = part.new_empty(part.shape[0], part.shape[1], depth_out, *part.shape[3:])
            out[:, :, d0:d1] = part
            del part
        ctx.save_for_backward(x, weight)
        ctx.conf, ctx.has_bias = (stride, padding, dilation), bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.conf
        k, s, dil = weight.shape[2], stride[0], dilation[0]
        grad_out = grad_out.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        pads = [p for pad in reversed(padding) for p in (pad, pad)]
        xp = F.pad(x, pads)
        grad_xp = torch.zeros_like(xp) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None
        if need_x or need_w:
            for d0, d1 in _slabs(grad_out.shape[2], xp.shape[3] * xp.shape[4], x.shape[0]):
                i0, i1 = d0 * s, (d1 - 1) * s + dil * (k - 1) + 1
                gx, gw, _ = torch.ops.aten.convolution_backward(
                    grad_out[:, :, d0:d1].contiguous(), xp[:, :, i0:i1].contiguous(), weight, None, list(stride), [0, 0, 0],
                    list(dilation), False, [0, 0, 0], 1, [need_x, need_w, False],
                )  # fmt: skip
                if need_x:
                    grad_xp[:, :, i0:i1] += gx  # slabs overlap by the kernel's halo: contributions add
                if need_w:
                    grad_w += gw
                del gx, gw
        if need_x:
            d, h, w = padding
            grad_x = grad_xp[
                :, :, d : grad_xp.shape[2] - d, h : grad_xp.shape[3] - h, w : grad_xp.shape[4] - w
            ]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.sum((0, 2, 3, 4))
        return grad_x, grad_w, grad_b, None, None, None


class SlabConv(nn.Conv3d):
    """``nn.Conv3d`` whose training forward runs in depth slabs (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or x.dim() != 5 or x.device.type != "cpu":
            return super().forward(x)  # inference and GPUs: cuDNN does not pad channels like this
        return _SlabConvFn.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation)


def sliceable(conv: nn.Module) -> bool:
    """A plain zero-padded 3D convolution with few input channels and a cubic stride/dilation."""
    return (
        type(conv) is nn.Conv3d
        and conv.in_channels <= MAX_IN_CHANNELS
        and conv.groups == 1
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
        and len(set(conv.stride)) == 1
        and len(set(conv.dilation)) == 1
    )


def slice_narrow_convs(model: nn.Module) -> list[str]:
    """Make every :func:`sliceable` convolution of ``model`` a :class:`SlabConv`; their paths."""
    done = []
    for name, module in model.named_modules():
        if sliceable(module):
            module.__class__ = SlabConv
            done.append(name)
    return done
