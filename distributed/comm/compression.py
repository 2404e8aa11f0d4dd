"""Fixed-bit gradient compression with error feedback (pure torch).

A tensor ``x`` is sent as one float32 scale ``s`` and one ``bits``-bit code per element.

Quantiser
---------
Symmetric and uniform, with ``m = 2**(bits - 1) - 1`` levels on each side of zero::

    bits = 2  ->  m = 1    codes {-1, 0, 1}          (ternary)
    bits = 4  ->  m = 7    15 levels
    bits = 8  ->  m = 127  255 levels

The scale comes from the tensor's own statistics::

    s = max|x|                                  when clip is None
    s = min(max|x|, clip * rms(x))              otherwise, rms(x) = sqrt(mean(x**2))

(:class:`ErrorFeedback` raises the threshold ``clip * rms(x)`` to a floor set by its residual.)

and every element is coded and decoded as::

    code    = clamp(round(x / s * m), -m, m) + m          stored as uint8 in 0 .. 2m
    decoded = (code - m) * s / m

For ``|x| <= s`` the error is at most half a step, ``|decoded - x| <= s / (2m)``. Elements beyond
``+-s`` saturate to ``+-s`` (error ``|x| - s``): clipping trades those few large errors for a finer
step on the bulk of the values, the per-layer threshold from gradient statistics of Jiang et al.
2020 ("4Bit"), and error feedback carries the clipped excess into the next step. ``s = 0`` (an
all-zero tensor) codes every element as ``m`` and decodes to zeros. A non-finite input gives a
non-finite scale, so the decoded tensor is non-finite too and an AMP grad scaler still sees the
overflow.

Wire format
-----------
:func:`encode` returns one uint8 tensor ``[4 bytes: s as float32][codes packed 8/bits per byte]``
(native byte order; all workers of a job share one architecture), :func:`encoded_nbytes` gives its
length, ``4 + ceil(numel * bits / 8)``.

Error feedback
--------------
:class:`ErrorFeedback` keeps one residual ``e`` per key (per layer) and sends the compression of
``x + e`` instead of ``x`` (Karimireddy et al., ICML 2019); see its docstring for the invariant.

Default clip per bit width (:data:`DEFAULT_CLIP`)
-------------------------------------------------
Chosen by measurement (``ErrorFeedback`` with its default floor, 200 steps of 2**16-element
gradients): mean squared error of the decoded values per step / largest running-sum error, for
Gaussian (rms 1), Laplace (rms 1.41) and Gaussian with 0.1 % of elements offset by +8 at every step:

====  =====  ==============  ==============  ==============
bits  clip   Gaussian        Laplace         outliers
====  =====  ==============  ==============  ==============
8     None   0.0002 / 0.0    0.0014 / 0.1    0.0011 / 0.0
8     4.0    0.0002 / 1.2    0.0139 / 10.3   0.0019 / 18.6
4     None   0.069 / 0.4     0.45 / 1.1      0.38 / 0.9
4     2.0    0.035 / 3.5     0.14 / 12.3     0.22 / 18.6
4     2.5    0.026 / 2.7     0.13 / 12.4     0.22 / 18.6
4     3.0    0.032 / 2.3     0.11 / 11.7     0.22 / 18.6
4     4.0    0.056 / 1.4     0.12 / 10.3     0.22 / 18.6
2     None   4.7 / 4.2       13.8 / 11.5     10.6 / 10.1
2     0.5    0.37 / 7.3      1.18 / 14.6     5.2 / 35.2
2     1.0    0.36 / 7.1      1.18 / 16.8     5.2 / 35.2
2     1.5    0.49 / 4.6      1.21 / 15.3     5.2 / 35.2
====  =====  ==============  ==============  ==============

* 8 bits: ``None``. With 127 levels the step ``max|x| / 127`` is already fine; a clip only adds
  saturation error that error feedback then has to carry.
* 4 bits: ``2.5``. With 7 levels the step ``max|x| / 7`` rounds most of a bell-shaped gradient (whose
  maximum is 4-5 rms) to 0 or one step; ``s = 2.5 rms`` saturates about 1 % of Gaussian values for a
  step of 0.36 rms, and cuts the per-step error 2.7x (Gaussian) to 3.5x (Laplace) against no clip;
  3.0 is a little better on the heavier Laplace tail, 2.5 on the Gaussian.
* 2 bits: ``1.0``. Ternary codes round every ``|x| < s/2`` to zero; with ``s = max|x|`` nearly
  everything is zero and the residual must build up for many steps before a value is sent (13x the
  error). ``s = rms`` sends about 60 % of Gaussian values as +-rms.

The running-sum error stays bounded in every row (it is one residual, see :class:`ErrorFeedback`);
clipping makes it larger than the per-step error because clipped excess waits a few steps. With
clipping, :class:`ErrorFeedback` keeps the scale above a fraction of its largest residual
(:data:`DEFAULT_FLOOR`), which bounds the residual when a few elements are large at every step
(without it the outlier column reads 126 at 4 bits and 272 at 2 bits after 300 steps, still rising).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from medseg.errors import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED_BITS: tuple[int, ...] = (2, 4, 8)

DEFAULT_CLIP: dict[int, float | None] = {8: None, 4: 2.5, 2: 1.0}
"""Clip factor (in units of the tensor's rms) used when none is given; see the module docstring."""

DEFAULT_FLOOR: dict[int, float] = {8: 0.5, 4: 0.5, 2: 0.25}
"""Residual floor ``gamma`` of :class:`ErrorFeedback` (used only with a clip); see its docstring."""

DEFAULT = "default"
"""Sentinel for a ``clip`` argument: use ``DEFAULT_CLIP[bits]``."""

SCALE_NBYTES = 4


def levels(bits: int) -> int:
    """Return ``m = 2**(bits - 1) - 1``, the number of quantisation levels on each side of zero."""
    check_bits(bits)
    return 2 ** (bits - 1) - 1


def check_bits(bits: int) -> None:
    """Raise :class:`ConfigError` unless ``bits`` is one of :data:`SUPPORTED_BITS`."""
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ConfigError(
            f"compression bits: {bits!r} is not supported; use one of {', '.join(map(str, SUPPORTED_BITS))}"
        )


def resolve_clip(bits: int, clip: float | None | str = DEFAULT) -> float | None:
    """Return the clip factor to use: ``DEFAULT_CLIP[bits]`` for ``"default"``, else ``clip`` checked.

    A clip factor must be a finite number > 0 (``None`` means no clipping, ``s = max|x|``).
    """
    check_bits(bits)
    if isinstance(clip, str):
        if clip != DEFAULT:
            raise ConfigError(
                f"compression clip: {clip!r} is not a number; use a float > 0, None or 'default'"
            )
        return DEFAULT_CLIP[bits]
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
        raise ConfigError(f"compression clip: {clip!r} must be a finite number > 0 or None")
    return float(clip)


def _check_clip(clip: float | None) -> None:
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0
    ):
        raise ConfigError(f"compression clip: {clip!r} must be a finite number > 0 or None")


def quantize(
    x: Tensor, bits: int, clip: float | None = None, floor: float | Tensor = 0.0
) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` to ``bits``-bit codes; return ``(codes, scale)``.

    ``codes`` is a flat uint8 tensor of ``x.numel()`` values in ``0 .. 2m`` and ``scale`` a float32 0-d
    tensor ``s`` (see the module docstring for ``s``, ``m`` and the error bound), both on ``x``'s device.
    With a clip factor, ``floor`` raises the clip threshold: ``s = min(max|x|, max(clip * rms(x), floor))``
    (:class:`ErrorFeedback` passes a fraction of its largest residual; 0 gives the plain formula).
    """
    m = levels(bits)
    _check_clip(clip)
    xf = x.detach().reshape(-1).to(torch.float32)
    if xf.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device), torch.zeros((), device=x.device)
    scale = xf.abs().max()
    if clip is not None:
        threshold = clip * xf.square().mean().sqrt()
        threshold = torch.maximum(threshold, torch.as_tensor(floor, dtype=torch.float32, device=x.device))
        scale = torch.minimum(scale, threshold)
    # s = 0 only for an all-zero tensor (rms = 0 iff every element is 0): divide by 1 instead.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf * (m / safe)).clamp_(-m, m).add_(m)
    # NaN (non-finite input) would give an undefined uint8; the scale is already non-finite then.
    q = torch.nan_to_num_(q, nan=float(m))
    return q.to(torch.uint8), scale


def dequantize(codes: Tensor, scale: Tensor, bits: int) -> Tensor:
    """Return ``(codes - m) * s / m`` as a flat float32 tensor."""
    m = levels(bits)
    return (codes.to(torch.float32) - m) * (scale.to(torch.float32) / m)


def _shifts(bits: int, device: torch.device) -> Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 ``codes`` (each ``< 2**bits``) ``8 // bits`` to a byte, little end first, zero padded.

    Code ``i`` lands in byte ``i // k`` at bit offset ``bits * (i % k)``, ``k = 8 // bits``; the result
    has ``ceil(numel * bits / 8)`` bytes.
    """
    check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ConfigError(f"pack: codes must be uint8, got {codes.dtype}")
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.clone()
    per = 8 // bits
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # Shifted fields do not overlap, so their sum is their bitwise or and never exceeds 255.
    return (flat.view(-1, per) << _shifts(bits, flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack`: return the first ``numel`` codes stored in ``packed``."""
    check_bits(bits)
    flat = packed.reshape(-1)
    if flat.numel() * 8 < numel * bits:
        raise ConfigError(f"unpack: {flat.numel()} bytes cannot hold {numel} codes of {bits} bits")
    if bits == 8:
        return flat[:numel].clone()
    mask = (1 << bits) - 1
    codes = (flat.view(-1, 1) >> _shifts(bits, flat.device)) & mask
    return codes.reshape(-1)[:numel]


def encoded_nbytes(numel: int, bits: int) -> int:
    """Length in bytes of :func:`encode`'s output: ``4 + ceil(numel * bits / 8)``."""
    check_bits(bits)
    return SCALE_NBYTES + (numel * bits + 7) // 8


def encode(x: Tensor, bits: int, clip: float | None = None, floor: float | Tensor = 0.0) -> Tensor:
    """Quantise (:func:`quantize`) and pack ``x``: uint8 ``[scale as 4 float32 bytes][packed codes]``."""
    codes, scale = quantize(x, bits, clip, floor)
    header = scale.reshape(1).to(torch.float32).view(torch.uint8)
    return torch.cat([header, pack(codes, bits)])


def decode(buf: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`encode`: the flat float32 tensor of ``numel`` decoded values."""
    check_bits(bits)
    flat = buf.reshape(-1)
    if flat.dtype != torch.uint8 or flat.numel() != encoded_nbytes(numel, bits):
        raise ConfigError(
            f"decode: expected {encoded_nbytes(numel, bits)} uint8 bytes for {numel} values of {bits} bits, "
            f"got {flat.numel()} of {flat.dtype}"
        )
    # clone: a float32 view needs a 4-byte aligned storage offset, a slice of a received buffer need not be.
    scale = flat[:SCALE_NBYTES].clone().view(torch.float32)[0]
    return dequantize(unpack(flat[SCALE_NBYTES:], bits, numel), scale, bits)


def split_sizes(numel: int, n: int) -> list[int]:
    """Sizes of ``n`` near-equal contiguous chunks of ``numel`` elements (the first ``numel % n`` one larger)."""
    if n < 1:
        raise ConfigError(f"split_sizes: number of chunks must be >= 1, got {n}")
    q, r = divmod(numel, n)
    return [q + 1 if j < r else q for j in range(n)]


class ErrorFeedback:
    """Error-feedback compressor: one residual per key, compress ``x + residual``.

    State: ``e_k``, a float32 tensor shaped like the key's input, zeros before the first call.
    One call with input ``x_t`` does::

        v_t       = x_t + e_{t-1}
        buf_t     = encode(v_t, floor = gamma * max|e_{t-1}|)   (per chunk in compress_chunks)
        decoded_t = decode(buf_t)
        e_t       = v_t - decoded_t

    Summing ``decoded_t = x_t + e_{t-1} - e_t`` over ``t = 1..T`` telescopes (``e_0 = 0``)::

        sum_t decoded_t = sum_t x_t - e_T

    so the running sum of what is sent tracks the true running sum with an error of exactly one
    residual, which does not grow with ``T`` (Karimireddy et al., ICML 2019): whatever rounding and
    clipping drop in one step is sent in later ones. Without feedback the rounding errors add up.

    The residual itself stays bounded. Without clipping ``|e_t| <= s_t / (2m)``. With clipping, an
    element that saturates keeps ``|v| - s``; an element whose gradient is large at every step (a
    persistent outlier) would saturate again and again, and since ``clip * rms`` hardly moves when a
    few elements grow, its residual would climb to many times the gradient itself. The floor
    ``s >= gamma * max|e_{t-1}|`` stops that: a saturated element keeps
    ``|e_t| = |v| - s <= |x_t| + (1 - gamma) max|e_{t-1}|``, hence ``max|e| <= max_t max|x_t| / gamma``
    (for ``gamma <= 1``). Measured on 2**16 Gaussian values with 0.1 % of them offset by +8 rms at every
    step (300 steps, 4 bits, clip 2.5): largest running-sum error 126 without the floor, 19 with
    gamma = 0.5; Gaussian and Laplace gradients were not affected. Ternary codes keep larger residuals
    in normal operation, so 2 bits use gamma = 0.25 (35 instead of 272 in the same test; gamma = 0.5
    would have doubled the per-step error on Laplace gradients). See :data:`DEFAULT_FLOOR`.

    Args:
        bits: code width, 2, 4 or 8.
        clip: clip factor (see the module docstring); ``"default"`` takes ``DEFAULT_CLIP[bits]``.
        floor: ``gamma`` in ``[0, 1]``; ``"default"`` takes ``DEFAULT_FLOOR[bits]``; only used with a clip.
    """

    def __init__(self, bits: int, clip: float | None | str = DEFAULT, floor: float | str = DEFAULT) -> None:
        self.bits = bits
        self.clip = resolve_clip(bits, clip)
        if isinstance(floor, str):
            if floor != DEFAULT:
                raise ConfigError(f"error feedback floor: {floor!r} is not a number; use a float in [0, 1]")
            floor = DEFAULT_FLOOR[bits]
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= 1.0:
            raise ConfigError(f"error feedback floor: {floor!r} must be a number in [0, 1]")
        self.floor = float(floor)
        self._residuals: dict[str, Tensor] = {}

    def residual(self, key: str) -> Tensor | None:
        """The current residual ``e`` of ``key`` (None before its first call)."""
        return self._residuals.get(key)

    def reset(self) -> None:
        """Forget every residual (for example after the model was reloaded)."""
        self._residuals.clear()

    def state_dict(self) -> dict[str, Tensor]:
        """The residuals by key, for a checkpoint."""
        return {k: v.clone() for k, v in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore residuals saved by :meth:`state_dict`."""
        self._residuals = {k: v.detach().to(torch.float32).clone() for k, v in state.items()}

    def _residual_for(self, key: str, x: Tensor) -> Tensor:
        e = self._residuals.get(key)
        if e is None:
            return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if e.shape != x.shape:
            raise ConfigError(
                f"error feedback: key {key!r} had shape {tuple(e.shape)}, now {tuple(x.shape)}; "
                "call reset() when the model changes"
            )
        return e

    def _floor(self, e: Tensor) -> Tensor | float:
        if self.clip is None or self.floor == 0.0 or e.numel() == 0:
            return 0.0
        return self.floor * e.abs().max()

    def compress(self, key: str, x: Tensor) -> tuple[Tensor, Tensor]:
        """Compress ``x + e_key`` with one scale; return ``(buf, decoded)`` and update ``e_key``.

        ``decoded`` is float32 shaped like ``x``; ``buf`` is :func:`encode`'s output.
        """
        e = self._residual_for(key, x)
        v = x.detach().to(torch.float32) + e
        buf = encode(v, self.bits, self.clip, self._floor(e))
        decoded = decode(buf, self.bits, v.numel()).view(v.shape)
        self._residuals[key] = v - decoded
        return buf, decoded

    def compress_chunks(self, key: str, x: Tensor, sizes: Sequence[int]) -> tuple[list[Tensor], Tensor]:
        """Like :meth:`compress`, but ``x + e_key`` (flattened) is cut into chunks of ``sizes`` and each
        chunk is encoded with its own scale (and its own floor). The residual stays one tensor for the
        whole of ``x``.

        Returns ``(bufs, decoded)``: one encoding per chunk and the flat float32 decoded tensor.
        """
        sizes = [int(n) for n in sizes]
        if sum(sizes) != x.numel() or any(n < 0 for n in sizes):
            raise ConfigError(f"error feedback: chunk sizes {sizes} do not add up to {x.numel()}")
        e = self._residual_for(key, x)
        v = x.detach().to(torch.float32) + e
        bufs = [
            encode(vc, self.bits, self.clip, self._floor(ec))
            for vc, ec in zip(v.reshape(-1).split(sizes), e.reshape(-1).split(sizes))
        ]
        decoded = torch.cat([decode(b, self.bits, n) for b, n in zip(bufs, sizes)])
        self._residuals[key] = v - decoded.view(v.shape)
        return bufs, decoded
