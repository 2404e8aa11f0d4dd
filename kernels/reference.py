"""Pure-PyTorch reference of the fused normalisation + activation maths.

This module is the contract the native kernels (``csrc/``) implement and are tested against; it is
also the path used when no native build is available.

Notation, for an input ``x`` of shape ``(N, C, *spatial)`` with ``S`` spatial elements:

* a **statistics group** ``g`` is the set of elements that share one mean and variance:
  ``instance``: one ``(n, c)`` slice (``N*C`` groups of ``S`` elements);
  ``group``: the ``C/G`` channels of group ``g`` of sample ``n`` (``N*G`` groups);
  ``batch``: channel ``c`` across the batch (``C`` groups of ``N*S`` elements).
  ``M`` is the number of elements of a group.
* forward, with per-channel affine ``γ_c, β_c`` (1 and 0 without affine)::

      μ_g = mean(x),  σ_g⁻¹ = 1 / sqrt(var_biased(x) + eps)
      x̂ = (x − μ_g) σ_g⁻¹,   y = γ_c x̂ + β_c,   z = act(y)

* activations, with the positive branch taken where ``y > 0`` (PyTorch's convention)::

      relu        z = max(y, 0)                 not invertible
      leaky_relu  z = y (y>0), a y              inverse y = z / a        (a > 0)
      prelu       z = y (y>0), a_c y            inverse y = z / a_c      (a_c > 0), ∂L/∂a_c = Σ dz·y [y≤0]
      elu         z = y (y>0), α (eʸ − 1)       inverse y = log1p(z/α),  dz/dy = z + α
      identity    z = y

* backward, given ``dz``: ``dy = dz · act'(y)``; ``∂L/∂β_c = Σ dy``; ``∂L/∂γ_c = Σ dy x̂``;
  with ``dx̂ = γ_c dy`` and group means ``A_g = mean_g(dx̂)``, ``B_g = mean_g(dx̂ x̂)``::

      dx = σ_g⁻¹ (dx̂ − A_g − x̂ B_g)       when the statistics came from x (training)
      dx = σ_g⁻¹ dx̂                       when they are fixed (BatchNorm in eval mode)

  ``x̂`` and ``y`` come either from the saved *input* (``x̂ = (x − μ) σ⁻¹``) or, In-Place ABN's
  method, from the saved *output*: ``y = act⁻¹(z)``, ``x̂ = (y − β_c) / γ_c`` (needs γ_c ≠ 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NORMS = ("instance", "group", "batch")
ACTIVATIONS = ("identity", "relu", "leaky_relu", "prelu", "elu")
INVERTIBLE = ("identity", "leaky_relu", "prelu", "elu")


@dataclass(frozen=True)
class Spec:
    """What one fused layer computes. ``param`` is the leaky slope or the ELU alpha."""

    norm: str
    act: str
    num_groups: int = 1
    eps: float = 1e-5
    param: float = 0.0

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {ACTIVATIONS}, got {self.act!r}")


def _grouped(t: torch.Tensor, spec: Spec) -> torch.Tensor:
    """View ``t`` (N, C, *spatial) so that dims (1, 2)... reduce to one value per statistics group."""
    n, c = t.shape[:2]
    if spec.norm == "instance":
        return t.reshape(n, c, -1)
    if spec.norm == "group":
        return t.reshape(n, spec.num_groups, -1)
    return t.reshape(n, c, -1).transpose(0, 1).reshape(c, -1)  # batch: (C, N*S), a copy


def _reduce(t: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Sum over each statistics group: (N, C) / (N, G) / (C,)."""
    return _grouped(t, spec).sum(-1)


def _per_element(stat: torch.Tensor, like: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Broadcast a per-group statistic back to the shape of ``like``."""
    n, c = like.shape[:2]
    ones = (1,) * (like.dim() - 2)
    if spec.norm == "instance":
        return stat.reshape(n, c, *ones)
    if spec.norm == "group":
        per_channel = stat.reshape(n, spec.num_groups, 1).expand(n, spec.num_groups, c // spec.num_groups)
        return per_channel.reshape(n, c, *ones)
    return stat.reshape(1, c, *ones)


def _per_channel(p: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    if p is None:
        return None
    return p.reshape(1, -1, *(1,) * (like.dim() - 2)) if p.numel() > 1 else p.reshape(())


def group_size(x: torch.Tensor, spec: Spec) -> int:
    n, c = x.shape[:2]
    s = x[0, 0].numel()
    return {"instance": s, "group": (c // spec.num_groups) * s, "batch": n * s}[spec.norm]


def norm_stats(x: torch.Tensor, spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and inverse standard deviation (biased variance), accumulated in float64."""
    g = _grouped(x, spec).double()
    var, mean = torch.var_mean(g, dim=-1, unbiased=False)
    return mean.to(x.dtype), torch.rsqrt(var + spec.eps).to(x.dtype)


def activate(y: torch.Tensor, spec: Spec, prelu: torch.Tensor | None) -> torch.Tensor:
    if spec.act == "identity":
        return y
    if spec.act == "relu":
        return torch.relu(y)
    if spec.act == "leaky_relu":
        return torch.where(y > 0, y, y * spec.param)
    if spec.act == "prelu":
        return torch.where(y > 0, y, y * _per_channel(prelu, y))
    return torch.where(y > 0, y, spec.param * torch.expm1(y))  # elu


def invert(z: torch.Tensor, spec: Spec, prelu: torch.Tensor | None) -> torch.Tensor:
    """``y = act⁻¹(z)`` for the invertible activations."""
    if spec.act == "identity":
        return z
    if spec.act == "leaky_relu":
        return torch.where(z > 0, z, z / spec.param)
    if spec.act == "prelu":
        return torch.where(z > 0, z, z / _per_channel(prelu, z))
    if spec.act == "elu":
        return torch.where(z > 0, z, torch.log1p(z / spec.param))
    raise ValueError(f"{spec.act} cannot be inverted; keep the input instead")


def forward(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    spec: Spec,
    prelu: torch.Tensor | None = None,
) -> torch.Tensor:
    """``z = act(γ (x − μ) σ⁻¹ + β)`` (a new tensor)."""
    y = (x - _per_element(mean, x, spec)) * _per_element(invstd, x, spec)
    if weight is not None:
        y = y * _per_channel(weight, x)
    if bias is not None:
        y = y + _per_channel(bias, x)
    return activate(y, spec, prelu)


def backward(
    saved: torch.Tensor,
    grad_out: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    spec: Spec,
    prelu: torch.Tensor | None = None,
    *,
    from_output: bool,
    stats_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients ``(dx, dγ, dβ, da)`` from the saved output ``z`` or the saved input ``x``.

    ``dγ``/``dβ`` are per channel (None without affine); ``da`` is the PReLU slope gradient in the
    slope's own shape (None for other activations).
    """
    w = _per_channel(weight, saved)
    b = _per_channel(bias, saved)
    if from_output:
        y = invert(saved, spec, prelu)
        xhat = y
        if b is not None:
            xhat = xhat - b
        if w is not None:
            xhat = xhat / w
    else:
        xhat = (saved - _per_element(mean, saved, spec)) * _per_element(invstd, saved, spec)
        y = xhat
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
    pos = y > 0
    if spec.act in ("identity",):
        dy = grad_out
    elif spec.act == "relu":
        dy = torch.where(pos, grad_out, torch.zeros_like(grad_out))
    elif spec.act == "leaky_relu":
        dy = torch.where(pos, grad_out, grad_out * spec.param)
    elif spec.act == "prelu":
        dy = torch.where(pos, grad_out, grad_out * _per_channel(prelu, saved))
    else:  # elu: dz/dy = α eʸ = z + α on the negative side
        dy = torch.where(pos, grad_out, grad_out * spec.param * torch.exp(y))

    dprelu = None
    if spec.act == "prelu":
        contrib = torch.where(pos, torch.zeros_like(y), grad_out * y)
        dprelu = (contrib.sum([0, *range(2, y.dim())]) if prelu.numel() > 1 else contrib.sum()).reshape(
            prelu.shape
        )

    channel_dims = [0, *range(2, y.dim())]
    dweight = (dy * xhat).sum(channel_dims) if weight is not None else None
    dbias = dy.sum(channel_dims) if bias is not None else None

    dxhat = dy * w if w is not None else dy
    scale = _per_element(invstd, saved, spec)
    if not stats_grad:
        return dxhat * scale, dweight, dbias, dprelu
    m = group_size(saved, spec)
    a = _per_element(_reduce(dxhat, spec) / m, saved, spec)
    bmean = _per_element(_reduce(dxhat * xhat, spec) / m, saved, spec)
    dx = scale * (dxhat - a - xhat * bmean)
    return dx, dweight, dbias, dprelu
