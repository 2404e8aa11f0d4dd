"""How a cross-site round's model change travels: fixed-bit codes, or the top-k entries of each layer.

Both codecs keep an error-feedback residual ``e`` and send a compression ``C`` of ``a = x + e``
instead of the change ``x``, then keep ``e ← a − C(a)`` (Karimireddy et al., ICML 2019; for top-k,
Stich et al., NeurIPS 2018, "Sparsified SGD with memory"). Over rounds ``t = 1..T``::

    Σ_t C(a_t) + e_T = Σ_t x_t

so nothing a round withholds is lost, only delayed; every member of a site feeds the codec the same
``x`` (its members hold one model), so their messages and residuals are identical too, and the
receiving sites decode exactly what the sender applied to itself.

Top-k (:class:`TopkRounds`)
---------------------------
Per layer ``l`` of ``n_l`` entries, ``k_l = max(1, ceil(f · n_l))`` entries of largest ``|a|`` are
sent (``f`` = ``dist.topk_fraction``), as their int32 indices (ascending) and their values:
float32, or fixed-bit codes of ``dist.topk_bits`` bits with one scale per layer
(:mod:`~medseg.distributed.comm.compression`; the coding error goes to the residual as well). A
round's message has a fixed length whatever the values, ``Σ_l 4 k_l + 4 k_l`` bytes (float32
values) or ``Σ_l 4 k_l + 4 + ceil(k_l · bits / 8)`` (coded), so the sites can allgather it: for
``f = 0.01`` that is 1/50 of the float32 change (1/89 with 4-bit values). Deep Gradient Compression
(Lin et al., ICLR 2018) reports 270-600x at equal accuracy with ``f = 0.001`` and warm-up.

Staleness: the residual is kept in float64 so that the identity above holds to float64 rounding,
and it is what compensates for sparsification: an entry withheld for several rounds grows in
``|a|`` until it is sent in full. A change applied ``τ`` rounds late by the other sites is handled
by gssp's consensus rule (:class:`~medseg.distributed.sync.gssp.GroupStale`), unchanged: the
sparse ``C(a_t)`` is simply the change every site applies, so all sites still reach the same
model. DGC's momentum-factor masking has nothing to act on (gssp has no outer momentum).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from medseg.distributed.comm.compression import ErrorFeedback, check_bits, decode, encode, encoded_nbytes

INDEX_BYTES = 4  # int32


def decode_layers(buf: Tensor, sizes: Sequence[int], bits: int) -> Tensor:
    """Decode a concatenation of per-layer fixed-bit encodings into one flat float32 vector."""
    out, offset = [], 0
    for n in sizes:
        size = encoded_nbytes(n, bits)
        out.append(decode(buf[offset : offset + size], bits, n))
        offset += size
    return torch.cat(out)


class FixedRounds:
    """A round as fixed-bit codes, one scale per layer, with error feedback (``compression: fixed``)."""

    def __init__(self, sizes: Sequence[int], bits: int) -> None:
        self.sizes, self.bits = [int(n) for n in sizes], bits
        self.feedback = ErrorFeedback(bits)
        self.nbytes = sum(encoded_nbytes(n, bits) for n in self.sizes)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(message, decoded)``: the uint8 message of ``x`` (plus the residual) and what it decodes to."""
        codes, decoded = self.feedback.compress_chunks("delta", x, self.sizes)
        return torch.cat(codes), decoded

    def decode(self, buf: Tensor) -> Tensor:
        return decode_layers(buf, self.sizes, self.bits)

    def state_dict(self) -> dict[str, Tensor]:
        return self.feedback.state_dict()

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.feedback.load_state_dict(state)


def topk_counts(sizes: Sequence[int], fraction: float) -> list[int]:
    """``k_l = max(1, ceil(fraction · n_l))`` per layer (at most ``n_l``)."""
    return [min(int(n), max(1, math.ceil(fraction * int(n)))) for n in sizes]


def topk_nbytes(sizes: Sequence[int], fraction: float, bits: int = 0) -> int:
    """Bytes of one top-k round message (indices, then float32 values or ``bits``-bit codes)."""
    counts = topk_counts(sizes, fraction)
    values = sum(encoded_nbytes(k, bits) for k in counts) if bits else 4 * sum(counts)
    return INDEX_BYTES * sum(counts) + values


class TopkRounds:
    """A round as each layer's top-k entries of ``x + e``, with a float64 residual (module docstring)."""

    def __init__(self, sizes: Sequence[int], fraction: float, bits: int = 0) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        if bits:
            check_bits(bits)
        self.sizes, self.fraction, self.bits = [int(n) for n in sizes], float(fraction), int(bits)
        self.counts = topk_counts(self.sizes, self.fraction)
        self.nbytes = topk_nbytes(self.sizes, self.fraction, self.bits)
        self.residual: Tensor | None = None

    def _values_nbytes(self, k: int) -> int:
        return encoded_nbytes(k, self.bits) if self.bits else 4 * k

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(message, decoded)``: the message of ``x`` plus the residual, and the flat float32 change it
        carries (zero off the kept entries); the residual keeps the rest."""
        a = x.detach().reshape(-1).to(torch.float64)
        if self.residual is not None:
            a = a + self.residual
        parts: list[Tensor] = []
        sent = torch.zeros_like(a)
        offset = 0
        for n, k in zip(self.sizes, self.counts):
            layer = a[offset : offset + n]
            idx = torch.topk(layer.abs(), k, sorted=False).indices.sort().values
            values = layer[idx].to(torch.float32)
            if self.bits:
                coded = encode(values, self.bits)
                values = decode(coded, self.bits, k)
                parts += [idx.to(torch.int32).view(torch.uint8), coded]
            else:
                parts += [idx.to(torch.int32).view(torch.uint8), values.view(torch.uint8)]
            sent[offset + idx] = values.to(torch.float64)
            offset += n
        self.residual = a - sent
        return torch.cat(parts), sent.to(torch.float32)

    def decode(self, buf: Tensor) -> Tensor:
        """The flat float32 change of one message (indices out of a layer's range raise ValueError)."""
        out = torch.zeros(sum(self.sizes))
        pos = offset = 0
        for n, k in zip(self.sizes, self.counts):
            idx = buf[pos : pos + INDEX_BYTES * k].clone().view(torch.int32).to(torch.int64)
            pos += INDEX_BYTES * k
            size = self._values_nbytes(k)
            raw = buf[pos : pos + size]
            pos += size
            values = decode(raw, self.bits, k) if self.bits else raw.clone().view(torch.float32)
            if k and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise ValueError(f"top-k message: an index outside its layer of {n} entries")
            out[offset + idx] = values
            offset += n
        return out

    def state_dict(self) -> dict[str, Tensor]:
        return {} if self.residual is None else {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        r = state.get("residual")
        self.residual = None if r is None else r.to(torch.float64).clone()


def round_codec(
    compression: str, sizes: Sequence[int], bits: int, fraction: float = 0.01, topk_bits: int = 0
) -> FixedRounds | TopkRounds | None:
    """The codec of ``dist.compression`` for cross-site rounds (None: float32 rounds)."""
    if compression == "fixed":
        return FixedRounds(sizes, bits)
    if compression == "topk":
        return TopkRounds(sizes, fraction, topk_bits)
    return None
