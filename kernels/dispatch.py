"""One entry point for the fused norm + activation ops: native kernels when built, else the reference.

Both backends expose the same three calls (integer codes from ``NORM_CODES``/``ACT_CODES``)::

    norm_stats(x, norm, groups, eps) -> (mean, invstd)
    forward(x, mean, invstd, weight, bias, norm, groups, act, param, prelu, out) -> None
    backward(saved, grad_out, mean, invstd, weight, bias, norm, groups, act, param, prelu,
             from_output, stats_grad, grad_in) -> (dweight, dbias, dprelu)

``forward`` writes into ``out`` (which may be ``x``); ``backward`` writes dx into ``grad_in``
(which may be ``saved``). The maths is documented in :mod:`medseg.kernels.reference`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from medseg.kernels import native
from medseg.kernels import reference as ref

NORM_CODES, ACT_CODES = native.NORM_CODES, native.ACT_CODES
_NATIVE_DTYPES = (torch.float32, torch.float64)


def _spec(norm: int, groups: int, act: int, param: float, eps: float = 0.0) -> ref.Spec:
    return ref.Spec(ref.NORMS[norm], ref.ACTIVATIONS[act], num_groups=groups, eps=eps, param=param)


def _ref_norm_stats(x: torch.Tensor, norm: int, groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.norm_stats(x, ref.Spec(ref.NORMS[norm], "identity", num_groups=groups, eps=eps))


def _ref_forward(x, mean, invstd, weight, bias, norm, groups, act, param, prelu, out) -> None:
    out.copy_(ref.forward(x, mean, invstd, weight, bias, _spec(norm, groups, act, param), prelu))


def _ref_backward(
    saved,
    grad_out,
    mean,
    invstd,
    weight,
    bias,
    norm,
    groups,
    act,
    param,
    prelu,
    from_output,
    stats_grad,
    grad_in,
):
    spec = _spec(norm, groups, act, param)
    dx, dw, db, dp = ref.backward(
        saved,
        grad_out,
        mean,
        invstd,
        weight,
        bias,
        spec,
        prelu,
        from_output=from_output,
        stats_grad=stats_grad,
    )
    grad_in.copy_(dx)
    return dw, db, dp


REFERENCE = SimpleNamespace(norm_stats=_ref_norm_stats, forward=_ref_forward, backward=_ref_backward)


def ops_for(x: torch.Tensor) -> Any:
    """The backend for tensor ``x``: native for float32/float64 when built, else the reference."""
    if x.dtype in _NATIVE_DTYPES and native.backend_name(x.device) != "reference":
        return native.load()
    return REFERENCE


def backend_name() -> str:
    """``native-cpu``, ``native-cuda`` or ``reference``: what float32 tensors run on."""
    return native.backend_name()
