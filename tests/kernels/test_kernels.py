"""Fused norm + activation: gradcheck, equality with MONAI's unfused networks, converter report."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
from monai.networks.nets import DynUNet, SegResNet, UNet
from torch import nn

from medseg.kernels import dispatch, optimize_memory
from medseg.kernels.blocks import describe, norm_act, norm_act_conv
from medseg.kernels.functions import replayable_backward
from medseg.kernels.measure import saved_bytes

NORMS = {
    "instance": lambda: nn.InstanceNorm3d(4),
    "instance-affine": lambda: nn.InstanceNorm3d(4, affine=True),
    "group": lambda: nn.GroupNorm(2, 4),
    "batch": lambda: nn.BatchNorm3d(4),
}
ACTS = {
    "prelu": lambda: nn.PReLU(),
    "prelu-per-channel": lambda: nn.PReLU(4),
    "leaky_relu": lambda: nn.LeakyReLU(0.01),
    "elu": lambda: nn.ELU(0.7),
    "relu": lambda: nn.ReLU(),
}


# The fused-layer tests run on CUDA tensors too where CUDA is there (scripts/gpu_check.sh).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.fixture(params=["native", "reference"])
def backend(request, monkeypatch):
    """Run a test on the native kernels (when they build) and on the pure-PyTorch reference."""
    if request.param == "reference":
        monkeypatch.setattr(dispatch, "ops_for", lambda x: dispatch.REFERENCE)
        monkeypatch.setattr("medseg.kernels.functions.ops_for", lambda x: dispatch.REFERENCE)
    return request.param


def _layer(norm: str, act: str):
    torch.manual_seed(0)
    n, a = NORMS[norm]().double(), ACTS[act]().double()
    with torch.no_grad():  # away from the initial γ=1, β=0 so that the inverse is exercised
        for p in n.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return n, a


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm,act", list(itertools.product(NORMS, ACTS)))
def test_gradcheck_fused_functions(norm, act, backend, device):
    n, a = _layer(norm, act)
    n, a = n.to(device), a.to(device)
    spec = describe(n, a)
    x = torch.randn(2, 4, 3, 3, 4, dtype=torch.double, device=device, requires_grad=True)
    params = (x, *n.parameters(), *a.parameters())
    conv = nn.Conv3d(4, 2, 3, stride=2, padding=1).double().to(device)
    with replayable_backward():  # gradcheck runs backward repeatedly through one graph
        if act != "relu":
            # in place on a copy: the in-place forward and the inverse are what gets checked
            assert torch.autograd.gradcheck(
                lambda x, *_: norm_act(x * 1, n, a, spec, inplace=True), params, fast_mode=True
            )
        params = (*params, *conv.parameters())
        assert torch.autograd.gradcheck(
            lambda x, *_: norm_act_conv(x, n, a, conv, spec), params, fast_mode=True
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", NORMS)
def test_fused_equals_torch_modules(norm, backend, device):
    """Forward, input and parameter gradients against the plain modules, float32."""
    for act in ACTS:
        n, a = _layer(norm, act)
        n, a = n.float().to(device), a.float().to(device)
        spec = describe(n, a)
        x = torch.randn(2, 4, 6, 7, 8, device=device, requires_grad=True)
        g = torch.randn(2, 4, 6, 7, 8, device=device)
        params = [x, *n.parameters(), *a.parameters()]
        expected = torch.autograd.grad(a(n(x)), params, g)
        out = norm_act(x * 1, n, a, spec, inplace=True)
        torch.testing.assert_close(out, a(n(x)), rtol=1e-5, atol=1e-5)
        for e, got in zip(expected, torch.autograd.grad(out, params, g)):
            torch.testing.assert_close(got, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels-last", "plain"])
def test_norm_act_conv_on_narrow_input_equals_torch_modules(channels_last, monkeypatch):
    """SegResNet's 8-channel full-resolution triple, float32: both conv layouts give the modules' values."""
    from medseg.kernels import functions

    if not channels_last:
        monkeypatch.setattr(functions, "CL_MAX_CHANNELS", 0)
    torch.manual_seed(0)
    n, a, conv = nn.GroupNorm(4, 8), nn.ReLU(), nn.Conv3d(8, 6, 3, padding=1, bias=True)
    x = torch.randn(2, 8, 9, 10, 11, requires_grad=True)
    assert functions.channels_last(x, conv.weight) is channels_last
    g = torch.randn(2, 6, 9, 10, 11)
    params = [x, *n.parameters(), *conv.parameters()]
    expected_out = conv(a(n(x)))
    expected = torch.autograd.grad(expected_out, params, g)
    out = norm_act_conv(x, n, a, conv, describe(n, a))
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    for e, got in zip(expected, torch.autograd.grad(out, params, g)):
        assert got.is_contiguous()
        # float32 sums in another order: within 1e-5 of each gradient's own scale
        torch.testing.assert_close(got, e, rtol=1e-4, atol=1e-5 * float(e.abs().max()))


def test_batchnorm_running_stats_and_eval_mode(backend):
    n, a = _layer("batch", "leaky_relu")
    ref = copy.deepcopy(n)
    x = torch.randn(2, 4, 5, 5, 5, dtype=torch.double)
    for _ in range(3):
        norm_act(x * 1, n, a, describe(n, a), inplace=True)
        ref(x)
    torch.testing.assert_close(n.running_mean, ref.running_mean)
    torch.testing.assert_close(n.running_var, ref.running_var)
    assert int(n.num_batches_tracked) == int(ref.num_batches_tracked) == 3
    n.eval(), ref.eval()
    xe = x.clone().requires_grad_()
    out = norm_act(xe * 1, n, a, describe(n, a), inplace=True)
    torch.testing.assert_close(out, a(ref(x)))
    (dx,) = torch.autograd.grad(out.sum(), xe)
    xr = x.clone().requires_grad_()
    (dxr,) = torch.autograd.grad(a(ref(xr)).sum(), xr)
    torch.testing.assert_close(dx, dxr)


def _saved_storages(fn) -> tuple[torch.Tensor, set[int]]:
    ptrs: set[int] = set()

    def pack(t):
        ptrs.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, ptrs


def test_ill_conditioned_inverse_falls_back_to_saving_input(backend):
    n, a = _layer("instance-affine", "leaky_relu")
    x = torch.randn(2, 4, 3, 4, 5, dtype=torch.double, requires_grad=True)
    out, saved = _saved_storages(lambda: norm_act(x * 1, n, a, describe(n, a), inplace=True))
    assert out.untyped_storage().data_ptr() in saved  # well conditioned: the output is what is kept
    with torch.no_grad():
        n.weight[0] = 1e-4  # (y − β)/γ would lose precision: the function keeps x instead
    out, saved = _saved_storages(lambda: norm_act(x * 1, n, a, describe(n, a), inplace=True))
    assert out.untyped_storage().data_ptr() not in saved
    with replayable_backward():
        assert torch.autograd.gradcheck(
            lambda x, *_: norm_act(x * 1, n, a, describe(n, a), inplace=True), (x,)
        )


def test_saturated_elu_gives_finite_exact_gradients(backend):
    """An outlier far below the mean saturates ELU (z = −α in float32); its inverse would be −inf."""
    n, a = nn.InstanceNorm3d(2), nn.ELU()
    x = torch.randn(1, 2, 8, 8, 8)
    x[0, 0, 0, 0, 0] = -500.0
    conv = nn.Conv3d(2, 2, 3, padding=1)
    model = nn.Sequential(nn.Sequential(conv, n, a, nn.Conv3d(2, 1, 1)))
    plain = copy.deepcopy(model)
    optimize_memory(model)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ga,) = torch.autograd.grad(model(xa).sum(), xa)
    (gb,) = torch.autograd.grad(plain(xb).sum(), xb)
    assert torch.isfinite(ga).all()
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)


def test_sequence_never_overwrites_a_tensor_it_does_not_own(backend):
    for first in (nn.Identity(), nn.Dropout(0.2)):
        seq = nn.Sequential(nn.Sequential(first, nn.InstanceNorm3d(2), nn.LeakyReLU(0.1)))
        optimize_memory(seq)
        seq.eval()
        x = torch.randn(1, 2, 4, 4, 4)
        before = x.clone()
        seq(x)
        assert torch.equal(x, before)
    # two fused pairs in a row: the second must not overwrite what the first kept for backward
    pairs = nn.Sequential(
        nn.Sequential(
            nn.Conv3d(1, 2, 3), nn.InstanceNorm3d(2), nn.LeakyReLU(0.1), nn.InstanceNorm3d(2), nn.PReLU()
        )
    )
    plain = copy.deepcopy(pairs)
    optimize_memory(pairs)
    x = torch.randn(1, 1, 6, 6, 6)
    for m in (pairs, plain):
        m(x).square().sum().backward()
    for p, q in zip(pairs.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)  # conv bias before a norm: ~0


def test_second_backward_through_retained_graph_fails_loudly():
    """dx overwrites the dead saved output (Layrub); a retained graph cannot be replayed silently."""
    n, a = _layer("instance", "prelu")
    conv = nn.Conv3d(4, 4, 3, padding=1).double()
    x = torch.randn(1, 4, 4, 4, 4, dtype=torch.double, requires_grad=True)
    loss = conv(norm_act(x * 1, n, a, describe(n, a), inplace=True)).square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace operation"):
        loss.backward()


def _nets():
    return {
        "unet": lambda: UNet(3, 1, 3, (8, 16, 32), (2, 2), num_res_units=2),
        "segresnet": lambda: SegResNet(3, 8, 1, 3, norm=("GROUP", {"num_groups": 4})),
        "dynunet": lambda: DynUNet(
            3,
            1,
            3,
            [[3, 3, 3]] * 3,
            [[1, 1, 1], [2, 2, 2], [2, 2, 2]],
            [[2, 2, 2], [2, 2, 2]],
            norm_name=("INSTANCE", {"affine": True}),
        ),  # fmt: skip
        "dynunet-res": lambda: DynUNet(
            3,
            1,
            3,
            [[3, 3, 3]] * 3,
            [[1, 1, 1], [2, 2, 2], [2, 2, 2]],
            [[2, 2, 2], [2, 2, 2]],
            res_block=True,
        ),
        "unet-batchnorm": lambda: UNet(3, 1, 3, (8, 16, 32), (2, 2), num_res_units=1, norm="BATCH"),
    }


def _pair(name: str, dtype: torch.dtype, device: str = "cpu"):
    torch.manual_seed(0)
    original = _nets()[name]().to(dtype).to(device)
    with torch.no_grad():
        for p in original.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    fused = copy.deepcopy(original)
    report = optimize_memory(fused)
    return original, fused, report


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    from monai.losses import DiceCELoss

    loss = DiceCELoss(to_onehot_y=True, softmax=True)(model(x), y)
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _rel_errors(got: dict, expected: dict) -> dict[str, float]:
    # A conv bias followed by a norm has gradient exactly 0: its computed value is rounding noise,
    # so each error is taken relative to the larger of the parameter's and 1e-4 of the largest norm.
    floor = 1e-4 * max(g.norm() for g in expected.values())
    return {k: ((got[k] - e).norm() / max(e.norm(), floor)).item() for k, e in expected.items()}


def _batch(dtype):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 1, 32, 32, 32, generator=gen, dtype=dtype), torch.randint(
        0, 3, (2, 1, 32, 32, 32), generator=gen
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_nets()))
def test_converted_network_is_exact_in_float64(name, device):
    original, fused, report = _pair(name, torch.float64, device)
    assert report.converted and original.state_dict().keys() == fused.state_dict().keys()
    x, y = (t.to(device) for t in _batch(torch.float64))
    loss_o, grads_o = _grads(original, x, y)
    loss_f, grads_f = _grads(fused, x, y)
    assert abs(loss_f - loss_o) <= 1e-12 * abs(loss_o)
    worst = max(_rel_errors(grads_f, grads_o).values())
    assert worst < 1e-9, worst


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["unet", "segresnet", "dynunet"])
def test_converted_network_matches_in_float32(name, device):
    """Loss and every parameter gradient within 1e-5 relative of the unfused float32 network.

    Where the unfused float32 network is itself further than that from float64 (DynUNet's
    gradients, through instance norms over small maps, are ~1e-3 from float64 in float32), the
    fused one must be as close to float64 as the original, within a factor of 3.
    """
    original, fused, _ = _pair(name, torch.float32, device)
    exact = copy.deepcopy(original).double()
    x, y = (t.to(device) for t in _batch(torch.float32))
    loss_o, grads_o = _grads(original, x, y)
    loss_f, grads_f = _grads(fused, x, y)
    _, grads_64 = _grads(exact, x.double(), y)
    assert abs(loss_f - loss_o) <= 1e-5 * abs(loss_o)
    fused_vs_orig = _rel_errors(grads_f, grads_o)
    orig_err = _rel_errors({k: g.double() for k, g in grads_o.items()}, grads_64)
    fused_err = _rel_errors({k: g.double() for k, g in grads_f.items()}, grads_64)
    for k, err in fused_vs_orig.items():
        assert err <= 1e-5 or fused_err[k] <= 3 * orig_err[k] + 1e-6, (k, err, fused_err[k], orig_err[k])


@pytest.mark.parametrize("name", ["unet", "segresnet", "dynunet"])
def test_converted_network_keeps_fewer_maps(name):
    original, fused, _ = _pair(name, torch.float32)
    x, _ = _batch(torch.float32)
    before = saved_bytes(original, list(original.parameters()), x)
    after = saved_bytes(fused, list(fused.parameters()), x)
    assert after <= 0.65 * before, (after, before)


def test_invertibility_is_decided_once_per_forward(monkeypatch):
    """After the first step, no fused layer reads its parameters on the host (a CUDA sync each):
    the model's pre-hook decides them all in one transfer, and an optimizer step invalidates that."""
    from medseg.kernels import functions

    model = UNet(3, 1, 2, (8, 16), (2,), num_res_units=1)
    optimize_memory(model)
    x = torch.randn(1, 1, 16, 16, 16)
    model(x).sum().backward()  # first step: layers register themselves
    calls = []
    monkeypatch.setattr(functions, "_invertible", lambda *a: calls.append(a) or True)
    transfers = []
    real = functions.invertibility
    monkeypatch.setattr(
        "medseg.kernels.blocks.invertibility", lambda sites: transfers.append(len(sites)) or real(sites)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.step()
        model(x).sum().backward()
    assert calls == [] and len(transfers) == 2 and transfers[0] >= 2, (calls, transfers)


def test_report_names_what_was_left_alone():
    model = UNet(3, 1, 2, (8, 16), (2,), num_res_units=1, dropout=0.2)
    report = optimize_memory(model)
    # dropout sits between every norm and its activation; only the skip concatenation is split
    assert list(report.converted) == ["model.1.cat"]
    assert report.skipped and all("activation" in why for why in report.skipped.values())

    seq = nn.Sequential(nn.Conv3d(1, 4, 3), nn.InstanceNorm3d(4), nn.ReLU(), nn.BatchNorm3d(4), nn.Tanh())
    report = optimize_memory(nn.Sequential(seq))
    assert "relu is not inverted" in report.skipped["0.1"]
    assert "Tanh" in report.skipped["0.3"]
    assert "fused" in report.format()

    seq = nn.Sequential(nn.InstanceNorm3d(4), nn.ReLU(), nn.Conv3d(4, 4, 3))
    wrapper = nn.Sequential(seq)
    report = optimize_memory(wrapper)
    assert "relu + conv" in report.converted["0.0"]
    x = torch.randn(1, 4, 6, 6, 6)
    torch.testing.assert_close(wrapper(x), seq[2](seq[1](seq[0](x))))


def test_converted_weights_load_into_the_plain_network():
    original, fused, _ = _pair("segresnet", torch.float32)
    with torch.no_grad():
        for p in fused.parameters():
            p.mul_(1.5)
    original.load_state_dict(fused.state_dict())
    x, _ = _batch(torch.float32)
    original.eval(), fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), original(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_training_with_fused_memory_reaches_the_same_dice(seg_data, seg_run, tmp_path, caplog):
    """The tiny demo run with ``train.memory: fused`` against the same run unfused (``seg_run``)."""
    # imported here so that the CUDA-only selection (scripts/gpu_check.sh) needs no training stack
    from medseg.training.loop import train
    from medseg.training.runlog import read_metrics
    from tests.conftest import tiny_seg_config

    caplog.set_level(logging.INFO, logger="medseg")
    fused = train(tiny_seg_config(seg_data, tmp_path, name="tiny-fused", memory="fused"), progress=False)
    plain = read_metrics(seg_run.run_dir / "metrics.jsonl")
    ours = read_metrics(fused.run_dir / "metrics.jsonl")
    assert len(ours) == len(plain)
    assert abs(ours[-1]["val_dice"] - plain[-1]["val_dice"]) <= 0.01, (ours[-1], plain[-1])
    assert "fused Dice+CE loss" in caplog.text
    assert (
        "train.memory=fused" in caplog.text
        and "fused 6 norm layers, split 2 skip concatenations, left 0" in caplog.text
    )


def test_bench_memory_cli_refuses_a_missing_gpu(tmp_path, capsys):
    from medseg.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "memory", "--device", "cuda", "--json", str(tmp_path / "m.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_largest_patch_prediction():
    from medseg.bench.memory import largest_patch

    assert largest_patch(100.0, 64, 100.0) == 64  # the budget is exactly the measured peak
    assert largest_patch(100.0, 64, 8 * 100.0) == 128  # 8x the memory: twice the side
    assert largest_patch(100.0, 64, 99.0) == 48


def test_measure_process_reports_the_json_schema():
    """One fresh process per variant, as `medseg bench memory` runs them (small UNet, 32³)."""
    from medseg.bench.memory import run_variant

    runs = {v: run_variant("unet", v, 32, 2, 2, "cpu", 300, 0.5) for v in ("baseline", "fused")}
    for r in runs.values():
        assert {"saved_bytes", "peak_bytes", "step_s"} <= set(r), r
        assert r["peak_bytes"] > 0 and r["step_s"] > 0
    assert runs["fused"]["saved_bytes"] < 0.7 * runs["baseline"]["saved_bytes"]
    assert runs["fused"]["backend"] in ("native-cpu", "reference")
