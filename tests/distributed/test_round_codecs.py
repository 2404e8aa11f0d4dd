"""Top-k cross-site rounds: error feedback loses nothing, the message is what its length formula says,
and a receiver decodes exactly what the sender applied to itself."""

from __future__ import annotations

import math

import pytest
import torch

from medseg.distributed.comm.round_codecs import TopkRounds, round_codec, topk_nbytes

pytestmark = pytest.mark.unit

SIZES = [3000, 17, 1, 640]


def _changes(steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed and drifting, as model changes are: some entries grow for many rounds
    drift = torch.randn(sum(SIZES), generator=g) * 0.01
    return [torch.randn(sum(SIZES), generator=g).pow(3) * 1e-3 + drift for _ in range(steps)]


@pytest.mark.parametrize("bits", [0, 4])
def test_what_was_sent_plus_the_residual_is_the_sum_of_the_changes(bits: int) -> None:
    """Σ_t sent_t + e_T = Σ_t x_t, summed independently in float64 (a dropped entry would show)."""
    codec = TopkRounds(SIZES, 0.02, bits)
    xs = _changes(30)
    sent = torch.zeros(sum(SIZES), dtype=torch.float64)
    for x in xs:
        _, decoded = codec.encode(x)
        sent += decoded.double()
    want = torch.stack([x.double() for x in xs]).sum(0)
    assert codec.residual is not None
    err = (sent + codec.residual - want).abs().max().item()
    assert err <= 1e-12 * want.abs().max().item(), err
    assert codec.residual.abs().max() > 0  # something was withheld: the identity had work to do


@pytest.mark.parametrize("bits", [0, 2, 4, 8])
def test_the_message_is_as_long_as_its_formula_and_decodes_to_what_was_applied(bits: int) -> None:
    codec = TopkRounds(SIZES, 0.01, bits)
    message, applied = codec.encode(_changes(1, seed=2)[0])
    counts = [max(1, math.ceil(0.01 * n)) for n in SIZES]
    values = sum(4 + math.ceil(k * bits / 8) for k in counts) if bits else 4 * sum(counts)
    assert message.dtype == torch.uint8 and message.numel() == 4 * sum(counts) + values == codec.nbytes
    receiver = TopkRounds(SIZES, 0.01, bits)
    assert torch.equal(receiver.decode(message), applied)
    assert int((applied != 0).sum()) <= sum(counts)
    if not bits:  # float32 values: the kept entries are the layer's largest, sent exactly
        x = _changes(1, seed=2)[0]
        layer = x[: SIZES[0]]
        kept = layer.abs().topk(counts[0]).indices
        assert torch.equal(applied[kept], layer[kept])


def test_a_message_with_an_index_outside_its_layer_is_refused() -> None:
    codec = TopkRounds(SIZES, 0.01)
    message, _ = codec.encode(_changes(1)[0])
    bad = message.clone()
    bad[:4] = torch.tensor([SIZES[0]], dtype=torch.int32).view(torch.uint8)  # first index = n_0
    with pytest.raises(ValueError, match="outside its layer"):
        codec.decode(bad)


def test_topk_rounds_are_fifty_times_smaller_than_float32_at_one_percent() -> None:
    sizes = [p.numel() for p in torch.nn.Conv3d(16, 32, 3).parameters()]
    assert topk_nbytes(sizes, 0.01) <= 4 * sum(sizes) / 49
    assert isinstance(round_codec("topk", sizes, 4, 0.01), TopkRounds)
    assert round_codec("none", sizes, 4) is None


def test_the_residual_survives_a_checkpoint() -> None:
    a, b = TopkRounds(SIZES, 0.05), TopkRounds(SIZES, 0.05)
    xs = _changes(3)
    a.encode(xs[0])
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.encode(xs[1])[0], b.encode(xs[1])[0])


def test_topk_is_taken_by_gssp_and_ssp_only() -> None:
    from medseg.config import ConfigError, config_from_dict

    for sync in ("gssp", "ssp"):
        cfg = config_from_dict({"dist": {"sync": sync, "compression": "topk", "topk_fraction": 0.05}})
        assert cfg.dist.topk_fraction == 0.05
    with pytest.raises(ConfigError, match="topk sparsifies gssp/ssp"):
        config_from_dict({"dist": {"sync": "bsp", "compression": "topk"}})
    with pytest.raises(ConfigError, match="topk_fraction must be in"):
        config_from_dict({"dist": {"sync": "gssp", "compression": "topk", "topk_fraction": 0}})
