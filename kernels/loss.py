"""Fused Dice + cross-entropy loss that keeps no full-resolution class maps (docs/design.md).

Equal to MONAI's ``DiceCELoss(to_onehot_y=True, softmax=True)`` with its defaults, which is the
loss medseg trains with: ``include_background=True`` (configurable), ``squared_pred=False``,
``jaccard=False``, ``smooth_nr = smooth_dr = 1e-5``, ``batch=False``, ``reduction="mean"``,
no class weights, ``lambda_dice = lambda_ce = 1``, no label smoothing.

For logits x of shape (N, C, S) (S voxels), integer labels y of shape (N, S), classes K (all C,
or 1..C-1 without background), p = softmax_c(x) and the sums I, P, G, D of :mod:`medseg.kernels.dice_ce`:

forward
    dice = 1/(N|K|) Σ_{n, c∈K} (1 − (2 I_nc + s_n) / D_nc)
    ce   = 1/(N S) Σ_{n,s} (logsumexp_c x_n·s − x_{n y_ns s})
    L    = λ_d dice + λ_c ce
backward (upstream gradient ḡ, a scalar)
    ∂L/∂p_ncs = a_nc [y_ns = c] + b_nc,  a_nc = −2 w / D_nc,  b_nc = w (2 I_nc + s_n) / D_nc²,
              w = ḡ λ_d / (N|K|)  (a = b = 0 for c ∉ K)
    ∂L/∂x_ncs = p_ncs (g_ncs − Σ_k p_nks g_nks) + e (p_ncs − [y_ns = c]),  e = ḡ λ_c / (N S)

Saved for backward: the logits (the network's output, which the last convolution does not keep),
the labels as uint8 (int32 beyond 255 classes) and the (N, C) coefficients. The per-voxel work runs
on the ops of :mod:`medseg.kernels.dice_ce` (native CPU/CUDA kernels, or the PyTorch reference).

Limits: softmax with integer labels only. Sigmoid / multi-label targets, class weights, label
smoothing, ``batch=True``, squared or Jaccard Dice are **not** supported: construct MONAI's
``DiceCELoss`` for those (``FusedDiceCELoss`` raises ``NotImplementedError`` when asked).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from medseg.kernels import dice_ce
from medseg.kernels.dice_ce import SMOOTH, dice_coefficients, include_mask, label_tensor
from medseg.kernels.head import head_dice_ce


class _FusedDiceCE(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, logits, labels, include_background, lambda_dice, lambda_ce, smooth_nr, smooth_dr):
        x = logits.contiguous().view(logits.shape[0], logits.shape[1], -1)
        n, c, s = x.shape
        stats, ce_sum = dice_ce.ops_for(x).forward(x, labels)
        if ce_sum.dim() == 2:  # native: (Σ CE, labels outside [0, C)); label_tensor() already checked them
            ce_sum = ce_sum[:, 0]
        include, k = include_mask(c, include_background, x.device)
        f, a, b = dice_coefficients(stats, include, smooth_nr, smooth_dr)
        dice = f.sum() / (n * k)
        ce = ce_sum.sum() / (n * s)
        loss = lambda_dice * dice + lambda_ce * ce
        ctx.save_for_backward(logits, labels, a, b)
        ctx.scale = (lambda_dice / (n * k), lambda_ce / (n * s))
        return loss.to(logits.dtype)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        logits, labels, a, b = ctx.saved_tensors
        x = logits.contiguous().view(logits.shape[0], logits.shape[1], -1)
        g = grad.double()
        w, e = g * ctx.scale[0], g * ctx.scale[1]
        grad_in = torch.empty_like(x)
        dice_ce.ops_for(x).backward(
            x, labels, (a * w).contiguous(), (b * w).contiguous(), e.reshape(1), grad_in
        )
        return grad_in.view_as(logits), None, None, None, None, None, None


class FusedDiceCELoss(nn.Module):
    """Drop-in for ``monai.losses.DiceCELoss(to_onehot_y=True, softmax=True, ...)`` (module docstring).

    ``forward(logits (N, C, *spatial), target (N, 1, *spatial) or (N, *spatial) class indices)``.
    ``logits`` may be the placeholder a fused head returns (``head.py``): the loss then makes the
    logits from the head's input slab by slab.
    """

    def __init__(
        self,
        include_background: bool = True,
        lambda_dice: float = 1.0,
        lambda_ce: float = 1.0,
        smooth_nr: float = SMOOTH,
        smooth_dr: float = SMOOTH,
        *,
        sigmoid: bool = False,
        batch: bool = False,
        squared_pred: bool = False,
        jaccard: bool = False,
        weight: Any = None,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        unsupported = {
            "sigmoid (multi-label)": sigmoid,
            "batch": batch,
            "squared_pred": squared_pred,
            "jaccard": jaccard,
            "weight": weight is not None,
            "label_smoothing": label_smoothing != 0.0,
        }
        asked = [k for k, v in unsupported.items() if v]
        if asked:
            raise NotImplementedError(
                f"FusedDiceCELoss supports softmax with integer labels only, not {', '.join(asked)}; "
                "use monai.losses.DiceCELoss for those"
            )
        if lambda_dice < 0 or lambda_ce < 0:
            raise ValueError("lambda_dice and lambda_ce must be >= 0")
        self.include_background = include_background
        self.lambda_dice, self.lambda_ce = float(lambda_dice), float(lambda_ce)
        self.smooth_nr, self.smooth_dr = float(smooth_nr), float(smooth_dr)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        head = logits.__dict__.get("_medseg_head")
        if head is not None:  # a fused head's placeholder (head.py): the logits are made slab by slab
            h, conv, residual = head
            return head_dice_ce(
                h, conv, residual, target, self.include_background, self.lambda_dice, self.lambda_ce,
                self.smooth_nr, self.smooth_dr,
            )  # fmt: skip
        if logits.dim() < 3:
            raise ValueError(f"logits must be (N, C, *spatial), got {tuple(logits.shape)}")
        c = logits.shape[1]
        if c < 2:
            raise NotImplementedError(
                "FusedDiceCELoss needs C >= 2 softmax channels (MONAI uses BCE for C = 1)"
            )
        logits = logits.as_subclass(torch.Tensor) if type(logits) is not torch.Tensor else logits
        labels = label_tensor(target, c)
        if labels.shape[1] != logits[0, 0].numel() or labels.shape[0] != logits.shape[0]:
            raise ValueError(f"target {tuple(target.shape)} does not match logits {tuple(logits.shape)}")
        return _FusedDiceCE.apply(
            logits,
            labels,
            self.include_background,
            self.lambda_dice,
            self.lambda_ce,
            self.smooth_nr,
            self.smooth_dr,
        )
