"""The Dice + cross-entropy ops shared by the fused loss (``loss.py``) and the fused head (``head.py``).

For logits x of shape (N, C, S) (S voxels), integer labels y of shape (N, S), p = softmax_c(x):

forward ops (``forward(x, y)``)
    I_nc = Σ_s p_ncs [y_ns = c],  P_nc = Σ_s p_ncs,  G_nc = Σ_s [y_ns = c]   (stats, (N, C, 3))
    Σ_s (logsumexp_c x_n·s − x_{n y_ns s})                                   (ce_sum, (N,))
coefficients (:func:`dice_coefficients`), with D_nc = P_nc + G_nc + s_d and include_c = [c ∈ K]
    f_nc = (1 − (2 I_nc + s_n) / D_nc) include_c        (the per-class Dice terms)
    a_nc = −2 / D_nc include_c,  b_nc = (2 I_nc + s_n) / D_nc² include_c
backward op (``backward(x, y, a, b, e, grad_in)``, a and b already scaled by w)
    ∂L/∂x_ncs = p_ncs (g_ncs − Σ_k p_nks g_nks) + e (p_ncs − [y_ns = c]),
    g_ncs = a_nc [y_ns = c] + b_nc

Forward reduces each voxel's C logits to the (N, C) sums and the cross-entropy sum; no softmax,
one-hot or log-softmax map is stored. Backward recomputes p voxel by voxel from the logits. The
native CPU/CUDA kernels are in ``csrc/dice_ce*``; :class:`DiceCEReference` is the same maths in
PyTorch and the fallback when they are not built.
"""

from __future__ import annotations

from typing import Any

import torch

from medseg.kernels import native

SMOOTH = 1e-5  # MONAI DiceLoss's default smooth_nr and smooth_dr
_NATIVE_DTYPES = (torch.float32, torch.float64)


def label_tensor(target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Labels (N, 1, *spatial) or (N, *spatial), float or integer, as contiguous (N, S) uint8/int32.

    Checks, without a device-to-host sync (``torch._assert_async``), that every label is an
    integer in [0, C): MONAI's one-hot would otherwise silently accept 1.5 or fail on 14 later.
    """
    y = target.as_subclass(torch.Tensor) if type(target) is not torch.Tensor else target
    if y.dim() >= 2 and y.shape[1] == 1:
        y = y[:, 0]
    y = y.reshape(y.shape[0], -1)
    ok = (y >= 0) & (y < num_classes)
    if y.is_floating_point():
        ok &= y == torch.floor(y)
    torch._assert_async(ok.all(), "fused DiceCE: labels must be integers in [0, num_classes)")
    dtype = torch.uint8 if num_classes <= 255 else torch.int32
    return y.to(dtype).contiguous()


class DiceCEReference:
    """The two ops in plain PyTorch (full-size temporaries; the fallback backend).

    ``forward(x, y) -> (stats (N, C, 3) float64 [I, P, G], ce_sum (N,) float64)``
    ``backward(x, y, a, b, e, grad_in)``: writes ∂L/∂x into ``grad_in`` (see module docstring).
    """

    @staticmethod
    def forward(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        yl = y.long()
        logp = torch.log_softmax(x, dim=1)
        p = logp.exp()
        onehot = torch.zeros_like(p).scatter_(1, yl[:, None], 1.0)
        stats = torch.stack([(p * onehot).sum(2), p.sum(2), onehot.sum(2)], dim=2).double()
        ce = -logp.gather(1, yl[:, None])[:, 0].double().sum(1)
        return stats, ce

    @staticmethod
    def backward(
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        e: torch.Tensor,
        grad_in: torch.Tensor,
    ) -> None:
        yl = y.long()[:, None]
        p = torch.softmax(x, dim=1)
        onehot = torch.zeros_like(p).scatter_(1, yl, 1.0)
        g = a.to(x.dtype)[..., None] * onehot + b.to(x.dtype)[..., None]
        dot = (p * g).sum(1, keepdim=True)
        grad_in.copy_(p * (g - dot) + e.to(x.dtype).reshape(-1, 1, 1) * (p - onehot))


def ops_for(x: torch.Tensor) -> Any:
    """Native ``dice_ce_forward``/``dice_ce_backward`` for float32/64 when built, else the reference."""
    if x.dtype in _NATIVE_DTYPES and native.backend_name(x.device) != "reference":
        mod = native.load()
        return _Native(mod)
    return DiceCEReference


class _Native:
    def __init__(self, mod: Any) -> None:
        self.forward, self.backward = mod.dice_ce_forward, mod.dice_ce_backward


def dice_coefficients(
    stats: torch.Tensor, include: torch.Tensor, smooth_nr: float, smooth_dr: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-(n, c) Dice terms f, and the backward coefficients a, b before the scale w (float64)."""
    inter, pred, ground = stats.unbind(2)
    denom = pred + ground + smooth_dr
    num = 2 * inter + smooth_nr
    f = (1 - num / denom) * include
    a = (-2 / denom) * include
    b = (num / denom**2) * include
    return f, a, b


def include_mask(classes: int, include_background: bool, device: torch.device) -> tuple[torch.Tensor, int]:
    """``include_c = [c ∈ K]`` as float64 on ``device``, and ``|K|``."""
    include = torch.ones(classes, dtype=torch.float64, device=device)
    if not include_background:
        include[0] = 0
    return include, classes - (0 if include_background else 1)
