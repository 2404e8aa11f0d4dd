"""Fixed-bit quantiser, bit packing, wire format and error feedback (pure torch, no Horovod)."""

from __future__ import annotations

import pytest
import torch

from medseg.distributed.comm.compression import (
    DEFAULT_CLIP,
    ErrorFeedback,
    decode,
    dequantize,
    encode,
    encoded_nbytes,
    levels,
    pack,
    quantize,
    split_sizes,
    unpack,
)
from medseg.errors import ConfigError

BITS = (2, 4, 8)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 8, 1001, 4096])
def test_pack_unpack_round_trip(bits: int, numel: int) -> None:
    g = torch.Generator().manual_seed(numel + bits)
    codes = torch.randint(0, 2**bits, (numel,), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == (numel * bits + 7) // 8
    assert torch.equal(unpack(packed, bits, numel), codes)


def test_pack_layout_is_little_end_first() -> None:
    codes = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4, 3]
    assert pack(torch.tensor([5, 10, 15], dtype=torch.uint8), 4).tolist() == [5 | 10 << 4, 15]


@pytest.mark.parametrize("bits", BITS)
def test_quantize_error_within_half_step(bits: int) -> None:
    m = levels(bits)
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(10_007, generator=g) * 3.0
    codes, scale = quantize(x, bits, clip=None)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2 * m
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert float(scale) == pytest.approx(float(x.abs().max()))
    err = (dequantize(codes, scale, bits) - x).abs()
    assert float(err.max()) <= float(scale) / (2 * m) * (1 + 1e-5)
    # the largest element is represented exactly (up to float rounding)
    assert float(err[x.abs().argmax()]) <= 1e-5 * float(scale)


@pytest.mark.parametrize("bits", BITS)
def test_clip_saturates_beyond_threshold(bits: int) -> None:
    x = torch.cat([torch.randn(999, generator=torch.Generator().manual_seed(0)), torch.tensor([50.0])])
    codes, scale = quantize(x, bits, clip=2.0)
    rms = float(x.square().mean().sqrt())
    assert float(scale) == pytest.approx(2.0 * rms)
    decoded = dequantize(codes, scale, bits)
    assert float(decoded[-1]) == pytest.approx(float(scale))
    inside = x.abs() <= scale
    m = levels(bits)
    assert float((decoded - x)[inside].abs().max()) <= float(scale) / (2 * m) * (1 + 1e-5)


@pytest.mark.parametrize("bits", BITS)
def test_all_zero_tensor(bits: int) -> None:
    x = torch.zeros(33)
    codes, scale = quantize(x, bits, clip=DEFAULT_CLIP[bits])
    assert float(scale) == 0.0
    assert torch.equal(codes, torch.full((33,), levels(bits), dtype=torch.uint8))
    out = decode(encode(x, bits, DEFAULT_CLIP[bits]), bits, 33)
    assert torch.equal(out, torch.zeros(33))
    buf, decoded = ErrorFeedback(bits).compress("w", x)
    assert torch.equal(decoded, x) and buf.numel() == encoded_nbytes(33, bits)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [0, 1, 5, 4097])
def test_encode_decode_round_trip(bits: int, numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(torch.float64)
    buf = encode(x.view(-1), bits, clip=None)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == encoded_nbytes(numel, bits) == 4 + -(-numel * bits // 8)
    codes, scale = quantize(x, bits, clip=None)
    assert torch.equal(buf[:4].view(torch.float32)[0], scale)
    assert torch.equal(decode(buf, bits, numel), dequantize(codes, scale, bits))
    # a slice at an odd offset (as inside a received buffer) decodes the same
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), buf])[3:]
    assert torch.equal(decode(shifted, bits, numel), decode(buf, bits, numel))


def test_decode_rejects_wrong_length() -> None:
    buf = encode(torch.ones(10), 4)
    with pytest.raises(ConfigError, match="expected 9"):
        decode(buf[:-1], 4, 10)


@pytest.mark.parametrize("bad", [3, 16, 0, True])
def test_bad_bits_raise_config_error(bad: int) -> None:
    with pytest.raises(ConfigError, match="bits"):
        quantize(torch.ones(4), bad)
    with pytest.raises(ConfigError):
        ErrorFeedback(bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), "auto"])
def test_bad_clip_raises_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="clip"):
        ErrorFeedback(4, clip=bad)  # type: ignore[arg-type]


def test_error_feedback_shape_change_is_an_error() -> None:
    ef = ErrorFeedback(4)
    ef.compress("w", torch.ones(5))
    with pytest.raises(ConfigError, match="'w'"):
        ef.compress("w", torch.ones(6))
    ef.reset()
    ef.compress("w", torch.ones(6))


def _running_sums(bits: int, feedback: bool, steps: int = 500, numel: int = 2000):
    """Running sums of inputs and decoded values over ``steps`` random gradients with a nonzero mean."""
    g = torch.Generator().manual_seed(7)
    ef = ErrorFeedback(bits)
    sum_x = torch.zeros(numel, dtype=torch.float64)
    sum_d = torch.zeros(numel, dtype=torch.float64)
    max_scale = 0.0
    for _ in range(steps):
        x = torch.randn(numel, generator=g) + 0.3
        if feedback:
            buf, d = ef.compress("layer", x)
        else:
            buf = encode(x, bits, ef.clip)
            d = decode(buf, bits, numel)
        max_scale = max(max_scale, float(buf[:4].view(torch.float32)[0]))
        sum_x += x.double()
        sum_d += d.double()
    return sum_x, sum_d, ef, max_scale


@pytest.mark.parametrize("bits", BITS)
def test_error_feedback_running_sum_tracks_inputs(bits: int) -> None:
    sum_x, sum_d, ef, max_scale = _running_sums(bits, feedback=True)
    diff = sum_d - sum_x
    residual = ef.residual("layer")
    assert residual is not None
    # sum_t decoded_t = sum_t x_t - e_T (float32 arithmetic over 500 steps)
    assert torch.allclose(diff, -residual.double(), atol=1e-3)
    ef_drift = float(diff.abs().max())
    assert ef_drift <= 3 * max_scale

    sum_x0, sum_d0, _, _ = _running_sums(bits, feedback=False)
    no_ef_drift = float((sum_d0 - sum_x0).abs().max())
    assert ef_drift < no_ef_drift / 5, (ef_drift, no_ef_drift)


@pytest.mark.parametrize("bits", [2, 4])
def test_residual_floor_bounds_persistent_outliers(bits: int) -> None:
    """Elements that are large at every step would otherwise pile up residual far beyond one gradient."""
    n = 1024
    g = torch.Generator().manual_seed(3)
    offset = torch.zeros(n)
    offset[torch.randperm(n, generator=g)[:2]] = 8.0
    bounded, unbounded = ErrorFeedback(bits), ErrorFeedback(bits, floor=0.0)
    largest = 0.0
    for _ in range(150):
        x = torch.randn(n, generator=g) + offset
        largest = max(largest, float(x.abs().max()))
        bounded.compress("w", x)
        unbounded.compress("w", x)
    # max|e| <= max|x| / gamma (gamma = DEFAULT_FLOOR[bits])
    assert float(bounded.residual("w").abs().max()) <= largest / bounded.floor
    assert float(unbounded.residual("w").abs().max()) > 3 * float(bounded.residual("w").abs().max())


def test_compress_chunks_keeps_one_residual_and_per_chunk_scales() -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(1))
    x[:10] *= 100  # chunk 0 gets a large scale, the others keep a fine one
    sizes = split_sizes(1001, 3)
    assert sizes == [334, 334, 333]
    ef = ErrorFeedback(8, clip=None)
    bufs, decoded = ef.compress_chunks("w", x, sizes)
    assert [b.numel() for b in bufs] == [encoded_nbytes(s, 8) for s in sizes]
    scales = [float(b[:4].view(torch.float32)[0]) for b in bufs]
    assert scales[0] > 20 * scales[1]
    assert torch.allclose(ef.residual("w"), x - decoded)
    for part, s in zip((x - decoded).split(sizes), scales):
        assert float(part.abs().max()) <= s / 254 * (1 + 1e-5)


def test_state_dict_round_trip() -> None:
    ef = ErrorFeedback(2)
    ef.compress("a", torch.randn(100))
    other = ErrorFeedback(2)
    other.load_state_dict(ef.state_dict())
    x = torch.randn(100)
    assert torch.equal(ef.compress("a", x)[1], other.compress("a", x)[1])
