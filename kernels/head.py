"""The network's last convolution ("head") fused with the Dice + CE loss: no full-resolution logits.

Why: with the fused loss (``loss.py``) the logits are still saved for backward, and backward still
builds their full gradient: 2 x C maps per voxel, a large share of the step's peak when C is large
(docs/benchmarks.md, ``unet-14cls``). Here the loss receives the head's *input* features h (kept
anyway: the head's convolution needs them for its weight gradient) with the head's weight W and
bias β, and makes the logits one depth slab at a time, never all at once.

Maths. The head is ``z = conv(h; W, β) [+ h]`` (a stride-1 "same" 3D convolution with odd kernel k,
zero padding k//2, and for MONAI's UNet an identity residual), z the logits (N, C, D, H, W). The loss
is ``loss.py``'s: with p = softmax_c(z), labels y, classes K,

    I_nc = Σ_s p_ncs [y_ns = c],  P_nc = Σ_s p_ncs,  G_nc = Σ_s [y_ns = c],  D_nc = P_nc + G_nc + s_d
    L = λ_d/(N|K|) Σ_{n,c∈K} (1 − (2 I_nc + s_n)/D_nc) + λ_c/(N S) Σ_{n,s} (logsumexp_c z_n·s − z_{n y_ns s})

These are sums over voxels, so with depth slabs σ_j = [d_j, d_{j+1}) they are sums over slabs:

forward   for each slab j: z_j = conv(h[d_j − k//2 : d_{j+1} + k//2] zero-padded in depth to the
          slab's halo; W, β) [+ h_j]; add the slab's (I, P, G, Σ CE) to the running totals; drop z_j.
backward  the coefficients a_nc = −2w/D_nc, b_nc = w(2 I_nc + s_n)/D_nc², e = ḡ λ_c/(N S),
          w = ḡ λ_d/(N|K|) need only the totals, so each slab's logits gradient is local:
            ∂L/∂z_ncs = p_ncs (g_ncs − Σ_k p_nks g_nks) + e (p_ncs − [y_ns = c]),  g_ncs = a_nc [y_ns = c] + b_nc
          for each slab j: recompute z_j, form ∂L/∂z_j, then
            ∂W += Σ_slab ∂L/∂z_j ⋆ h_j(halo)        (the convolution's weight gradient on the slab)
            ∂β += Σ_{n, s∈σ_j} ∂L/∂z_j
            ∂h[halo rows of j] += convᵀ(∂L/∂z_j; W)  (slabs overlap by the halo: contributions add)
            ∂h[σ_j] += ∂L/∂z_j                      (the identity residual, when there is one)

Exact up to the order of floating-point sums (slab by slab instead of all at once). Saved for
backward: h (the same storage the layer before keeps, so no new bytes), W, β, the labels (uint8)
and the (N, C) coefficients. Alive at once: one slab's logits, logits gradient and their
convolution buffers (a slab holds at most ``SLAB_BYTES`` of the wider of h and the logits, counted
with channels padded to oneDNN's blocks of 16, since a 3-class map is convolved as 16) and the full
∂h, which the rest of backward needs anyway. The slab loss terms and logits gradients run on
:mod:`medseg.kernels.dice_ce`'s ops (native CPU/CUDA kernels, the PyTorch reference without them);
the convolutions are PyTorch's own (oneDNN / cuDNN).

Wiring (``train.memory: fused``): ``optimize_memory`` turns the head module into a
:class:`DeferredHead` (class swap: parameter names and state_dicts are unchanged). Inside
``with deferred_head(model):`` and with gradients on, its forward does not convolve: it returns a
zero-stride placeholder of the logits' shape that carries (h, head), and ``FusedDiceCELoss`` on that
placeholder runs :func:`head_dice_ce`. Everywhere else (validation, inference, the viewer, the
bundle) the head's forward is MONAI's own and the model returns the same logits.

Which heads fuse (:func:`find_head`): MONAI ``UNet`` with residual units (its last ``ResidualUnit``:
a conv-only 3x3x3 convolution plus an identity residual), ``DynUNet`` without deep supervision (its
1x1x1 ``output_block``). Not fused, with the fused loss on full logits instead: ``SegResNet`` (its
last convolution is already fused with the GroupNorm + ReLU before it, whose output is rebuilt rather
than kept; fusing it with the loss as well would need to keep that 16-channel map), UNet without
residual units (its last layer is a stride-2 transposed convolution), DynUNet with deep supervision
(several outputs), and any other network.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from medseg.kernels import dice_ce
from medseg.kernels.dice_ce import SMOOTH, dice_coefficients, include_mask, label_tensor

SLAB_BYTES = 4 * 2**20  # one slab's map of the wider of h and the logits, channels padded to 16
BLOCK = 16  # oneDNN convolves in blocks of 16 channels (AVX-512; 8 on AVX2): a 3-channel map costs 16


def _slabs(depth: int, per_depth_bytes: int) -> list[tuple[int, int]]:
    step = max(1, min(depth, SLAB_BYTES // max(per_depth_bytes, 1)))
    return [(d, min(d + step, depth)) for d in range(0, depth, step)]


def _per_depth_bytes(h: torch.Tensor, classes: int) -> int:
    """Bytes of one depth row of the wider of h and the logits in oneDNN's channel-blocked layout."""
    channels = -(-max(h.shape[1], classes) // BLOCK) * BLOCK
    return h.shape[0] * channels * h.shape[3] * h.shape[4] * h.element_size()


def _slab_input(h: torch.Tensor, d0: int, d1: int, p: int) -> tuple[torch.Tensor, int, int]:
    """h's rows d0 − p .. d1 + p, zero-padded in depth where they fall outside; (slab, lo, front)."""
    depth = h.shape[2]
    lo, hi = max(d0 - p, 0), min(d1 + p, depth)
    front, back = p - (d0 - lo), p - (hi - d1)
    part = h[:, :, lo:hi]
    if front or back:
        part = F.pad(part, (0, 0, 0, 0, front, back))
    return part.contiguous(), lo, front


def _slab_logits(h, weight, bias, d0, d1, p, residual):
    hs, lo, front = _slab_input(h, d0, d1, p)
    z = F.conv3d(hs, weight, bias, 1, (0, p, p))
    if residual:
        z += h[:, :, d0:d1]
    return z, hs, lo, front


class _HeadDiceCE(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, h, weight, bias, labels, residual, include_background, lambda_dice, lambda_ce, smooth):
        n, c = h.shape[0], weight.shape[0]
        depth, plane = h.shape[2], h.shape[3] * h.shape[4]
        p = weight.shape[2] // 2
        stats = torch.zeros(n, c, 3, dtype=torch.float64, device=h.device)
        ce_sum = torch.zeros(n, dtype=torch.float64, device=h.device)
        slabs = _slabs(depth, _per_depth_bytes(h, c))
        with torch.no_grad():
            for d0, d1 in slabs:
                z, *_ = _slab_logits(h, weight, bias, d0, d1, p, residual)
                zf = z.view(n, c, -1)
                st, ce = dice_ce.ops_for(zf).forward(zf, labels[:, d0 * plane : d1 * plane].contiguous())
                stats += st
                ce_sum += ce[:, 0] if ce.dim() == 2 else ce
                del z, zf
        include, k = include_mask(c, include_background, h.device)
        s = depth * plane
        f, a, b = dice_coefficients(stats, include, smooth[0], smooth[1])
        loss = lambda_dice * f.sum() / (n * k) + lambda_ce * ce_sum.sum() / (n * s)
        ctx.save_for_backward(h, weight, bias, labels, a, b)
        ctx.conf = (residual, slabs, (lambda_dice / (n * k), lambda_ce / (n * s)))
        return loss.to(h.dtype)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        h, weight, bias, labels, a, b = ctx.saved_tensors
        residual, slabs, scale = ctx.conf
        n, c, plane = h.shape[0], weight.shape[0], h.shape[3] * h.shape[4]
        p = weight.shape[2] // 2
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g = grad.double()
        aw, bw, e = (
            (a * g * scale[0]).contiguous(),
            (b * g * scale[0]).contiguous(),
            (g * scale[1]).reshape(1),
        )
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        with torch.no_grad():
            for d0, d1 in slabs:
                z, hs, lo, front = _slab_logits(h, weight, bias, d0, d1, p, residual)
                zf = z.view(n, c, -1)
                gz = torch.empty_like(zf)
                dice_ce.ops_for(zf).backward(
                    zf, labels[:, d0 * plane : d1 * plane].contiguous(), aw, bw, e, gz
                )
                del z, zf
                gz = gz.view(n, c, d1 - d0, *h.shape[3:])
                if need_h or need_w:
                    gx, gw, _ = torch.ops.aten.convolution_backward(
                        gz, hs, weight, None, [1, 1, 1], [0, p, p], [1, 1, 1], False, [0, 0, 0], 1,
                        [need_h, need_w, False],
                    )  # fmt: skip
                    if need_h:
                        rows = gx[:, :, front : front + min(d1 + p, h.shape[2]) - lo]
                        grad_h[:, :, lo : lo + rows.shape[2]] += rows
                        if residual:
                            grad_h[:, :, d0:d1] += gz
                    if need_w:
                        grad_w += gw
                    del gx, gw
                if grad_b is not None:
                    grad_b += gz.sum((0, 2, 3, 4))
                del gz, hs
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def head_dice_ce(
    h: torch.Tensor,
    conv: nn.Conv3d,
    residual: bool,
    target: torch.Tensor,
    include_background: bool = True,
    lambda_dice: float = 1.0,
    lambda_ce: float = 1.0,
    smooth_nr: float = SMOOTH,
    smooth_dr: float = SMOOTH,
) -> torch.Tensor:
    """Dice + CE of ``conv(h) [+ h]`` against class-index ``target``, in depth slabs (module docstring)."""
    check_conv(conv)
    h = h.as_subclass(torch.Tensor) if type(h) is not torch.Tensor else h
    if h.dim() != 5 or h.shape[1] != conv.in_channels:
        raise ValueError(f"head input must be (N, {conv.in_channels}, D, H, W), got {tuple(h.shape)}")
    if residual and conv.in_channels != conv.out_channels:
        raise ValueError("an identity residual needs as many input as output channels")
    c = conv.out_channels
    if c < 2:
        raise NotImplementedError("the fused head loss needs C >= 2 softmax channels")
    labels = label_tensor(target, c)
    if labels.shape != (h.shape[0], h[0, 0].numel()):
        raise ValueError(f"target {tuple(target.shape)} does not match the head input {tuple(h.shape)}")
    return _HeadDiceCE.apply(
        h.contiguous(), conv.weight, conv.bias, labels, residual, include_background,
        float(lambda_dice), float(lambda_ce), (float(smooth_nr), float(smooth_dr)),
    )  # fmt: skip


def check_conv(conv: nn.Module) -> None:
    """Raise ``ValueError`` unless ``conv`` is a stride-1, 'same'-padded, odd-kernel plain 3D conv."""
    reason = conv_reason(conv)
    if reason:
        raise ValueError(f"head convolution cannot be fused: {reason}")


def conv_reason(conv: nn.Module) -> str | None:
    if not isinstance(conv, nn.Conv3d) or conv.transposed:
        return f"{type(conv).__name__} is not a 3D convolution"
    k = conv.kernel_size
    if len(set(k)) != 1 or k[0] % 2 == 0:
        return f"kernel {k} is not cubic and odd"
    if conv.stride != (1, 1, 1) or conv.dilation != (1, 1, 1) or conv.groups != 1:
        return "stride, dilation and groups must be 1"
    if conv.padding_mode != "zeros" or tuple(conv.padding) != (k[0] // 2,) * 3:
        return f"padding {conv.padding} ({conv.padding_mode}) is not zero 'same' padding"
    return None


# ------------------------------------------------------------------ wiring into a network


class DeferredHead:
    """Mixin of a head module whose forward, inside :func:`deferred_head`, defers to the loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.__dict__.get("_medseg_defer") and torch.is_grad_enabled()):
            return super().forward(x)  # type: ignore[misc]
        conv, residual = self.__dict__["_medseg_head"]
        shape = (x.shape[0], conv.out_channels, *x.shape[2:])
        placeholder = x.new_zeros(()).as_subclass(torch.Tensor).expand(shape)
        placeholder.__dict__["_medseg_head"] = (x, conv, residual)
        return placeholder


def _deferred_class(cls: type) -> type:
    if issubclass(cls, DeferredHead):
        return cls
    if cls not in _CLASSES:
        # module-level name, so that a pickled model finds the class again
        new = type(f"Deferred{cls.__name__}", (DeferredHead, cls), {"__module__": __name__})
        globals()[new.__name__] = new
        _CLASSES[cls] = new
    return _CLASSES[cls]


_CLASSES: dict[type, type] = {}


def find_head(model: nn.Module) -> tuple[str, nn.Module, nn.Module, bool] | str:
    """``(path, head module, its conv, identity residual?)`` of a fusable head, or why there is none."""
    from monai.networks.blocks import Convolution, ResidualUnit
    from monai.networks.blocks.dynunet_block import UnetOutBlock
    from monai.networks.nets import DynUNet, SegResNet, UNet

    if isinstance(model, UNet):
        up = model.model[-1]
        if not isinstance(up, nn.Sequential) or not isinstance(up[-1], ResidualUnit):
            return "UNet without residual units ends in a stride-2 transposed convolution"
        last, path = up[-1], f"model.{len(model.model) - 1}.{len(up) - 1}"
        if not isinstance(last.residual, nn.Identity) or len(last.conv) != 1:
            return "UNet's last residual unit has a convolutional residual or several convolutions"
        unit = last.conv[0]
        if not isinstance(unit, Convolution) or list(unit._modules) != ["conv"]:
            return "UNet's last convolution is followed by a norm or activation"
        conv, head, residual = unit.conv, last, True
    elif isinstance(model, DynUNet):
        if model.deep_supervision:
            return "DynUNet with deep supervision has several outputs"
        if not isinstance(model.output_block, UnetOutBlock):
            return "DynUNet's output block is not MONAI's UnetOutBlock"
        conv, head, residual, path = model.output_block.conv.conv, model.output_block, False, "output_block"
    elif isinstance(model, SegResNet):
        return (
            "SegResNet's last convolution is fused with the GroupNorm + ReLU before it (map rebuilt, "
            "not kept); the loss takes its logits"
        )
    else:
        return f"{type(model).__name__}: no known head"
    reason = conv_reason(conv)
    if reason:
        return f"head convolution: {reason}"
    return path, head, conv, residual


def fuse_head(model: nn.Module) -> tuple[str | None, str]:
    """Make ``model``'s head a :class:`DeferredHead` (module docstring): ``(its path, "")`` or ``(None, why not)``."""
    found = find_head(model)
    if isinstance(found, str):
        model.__dict__.pop("_medseg_head_module", None)
        return None, found
    path, head, conv, residual = found
    head.__class__ = _deferred_class(type(head))
    head.__dict__["_medseg_head"] = (conv, residual)
    model.__dict__["_medseg_head_module"] = head
    return path, ""


@contextlib.contextmanager
def deferred_head(model: nn.Module) -> Iterator[bool]:
    """Within: a fused head returns a placeholder for the fused head loss. Yields whether one is."""
    head = model.__dict__.get("_medseg_head_module")
    if head is None:
        yield False
        return
    head.__dict__["_medseg_defer"] = True
    try:
        yield True
    finally:
        head.__dict__["_medseg_defer"] = False


def deferred(logits: torch.Tensor) -> Any:
    """``(h, conv, residual)`` when ``logits`` is a deferred head's placeholder, else None."""
    return logits.__dict__.get("_medseg_head") if hasattr(logits, "__dict__") else None
