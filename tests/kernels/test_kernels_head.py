"""The head convolution fused with Dice + CE (kernels/head.py): equality with MONAI, gradcheck, wiring."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from monai.losses import DiceCELoss
from torch import nn

from medseg.kernels import dice_ce, optimize_memory
from medseg.kernels import head as fused_head
from medseg.kernels.dice_ce import DiceCEReference
from medseg.kernels.head import deferred_head, head_dice_ce
from medseg.kernels.loss import FusedDiceCELoss

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
# (kernel, identity residual): MONAI UNet's last residual unit, DynUNet's 1x1x1 output block
HEADS = {"k3-residual": (3, True), "k1": (1, False)}


@pytest.fixture(params=["native", "reference"])
def backend(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr(dice_ce, "ops_for", lambda x: DiceCEReference)
    return request.param


@pytest.fixture(params=["one-row-slabs", "default-slabs"])
def slabs(request, monkeypatch):
    """Slabs of one depth row each (every halo crosses slabs) and the default size (one slab here)."""
    if request.param == "one-row-slabs":
        monkeypatch.setattr(fused_head, "SLAB_BYTES", 1)
    return request.param


def _case(classes, kernel, residual, dtype, device, shape=(2, 6, 5, 7), seed=0, features=None):
    gen = torch.Generator().manual_seed(seed)
    cin = classes if residual else (features or 5)
    conv = nn.Conv3d(cin, classes, kernel, padding=kernel // 2).to(dtype)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen, dtype=torch.float64))
        conv.bias.copy_(torch.randn(classes, generator=gen, dtype=torch.float64))
    h = torch.randn(shape[0], cin, *shape[1:], generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, classes, (shape[0], 1, *shape[1:]), generator=gen).to(torch.float32)
    if classes > 3:  # an absent class
        labels[labels == 2] = 1
    return conv.to(device), h.to(device).requires_grad_(True), labels.to(device)


def _grads(loss, h, conv):
    return torch.autograd.grad(loss, (h, conv.weight, conv.bias))


def _monai(conv, h, labels, residual, include_background):
    h0 = h.detach().clone().requires_grad_(True)
    z = conv(h0) + (h0 if residual else 0)
    loss = DiceCELoss(to_onehot_y=True, softmax=True, include_background=include_background)(z, labels)
    return loss, _grads(loss, h0, conv)


def _fused(conv, h, labels, residual, include_background, **kw):
    h1 = h.detach().clone().requires_grad_(True)
    loss = head_dice_ce(h1, conv, residual, labels, include_background, **kw)
    return loss, _grads(loss, h1, conv)


def _close(l0, g0, l1, g1, tol):
    assert l1.dtype == l0.dtype
    assert abs(float(l1) - float(l0)) <= tol * max(1.0, abs(float(l0))), (float(l1), float(l0))
    for name, a, b in zip(("h", "weight", "bias"), g0, g1):
        err = float((b - a).abs().max()) / float(a.abs().max())
        assert err <= tol, (name, err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("classes,include_background", list(itertools.product([2, 3, 14], [True, False])))
def test_equals_monai_on_head_logits(classes, include_background, head, dtype, device, backend, slabs):
    kernel, residual = HEADS[head]
    conv, h, labels = _case(classes, kernel, residual, dtype, device)
    l0, g0 = _monai(conv, h, labels, residual, include_background)
    l1, g1 = _fused(conv, h, labels, residual, include_background)
    _close(l0, g0, l1, g1, TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("include_background", [True, False])
def test_gradcheck(include_background, head, device, backend, monkeypatch):
    monkeypatch.setattr(fused_head, "SLAB_BYTES", 1)  # one depth row per slab: halos cross slabs
    kernel, residual = HEADS[head]
    conv, h, labels = _case(3, kernel, residual, torch.float64, device, shape=(2, 3, 2, 3))
    w = conv.weight.detach().clone().requires_grad_(True)
    b = conv.bias.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x, w_, b_: _gc(x, w_, b_, residual, labels, include_background), (h, w, b)
    )


def _gc(x, w, b, residual, labels, include_background):
    """head_dice_ce with the weight and bias as explicit inputs (gradcheck perturbs them)."""
    labels_t = dice_ce.label_tensor(labels, w.shape[0])
    return fused_head._HeadDiceCE.apply(
        x, w, b, labels_t, residual, include_background, 0.7, 1.3, (1e-5, 1e-5)
    )


def test_saves_no_logits_sized_map():
    """Only h (the caller's), the weights, uint8 labels and (N, C) coefficients are saved."""
    conv, h, labels = _case(14, 3, True, torch.float32, "cpu", shape=(2, 16, 16, 16))
    seen: dict[int, int] = {}

    params = {p.untyped_storage().data_ptr() for p in conv.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head_dice_ce(h, conv, True, labels)
    voxels = 2 * 16**3
    big = sorted(v for v in seen.values() if v >= voxels)
    assert big == [voxels, h.numel() * 4], big  # the labels and h itself, nothing of the logits
    assert h.untyped_storage().data_ptr() in seen


def _small(net: str, classes: int) -> nn.Module:
    from monai.networks.nets import DynUNet, SegResNet, UNet

    torch.manual_seed(0)
    if net == "unet":
        return UNet(3, 1, classes, channels=(4, 8, 16), strides=(2, 2), num_res_units=2, norm="instance")
    if net == "dynunet":
        return DynUNet(
            3,
            1,
            classes,
            kernel_size=[3, 3, 3],
            strides=[1, 2, 2],
            upsample_kernel_size=[2, 2],
            filters=[4, 8, 16],
        )
    return SegResNet(
        3, init_filters=8, in_channels=1, out_channels=classes, blocks_down=(1, 1), blocks_up=(1,)
    )


@pytest.mark.parametrize("net,classes", [("unet", 14), ("unet", 3), ("dynunet", 3)])
def test_model_loss_and_gradients_equal_unfused_monai(net, classes):
    """The converted network trained through its fused head: MONAI's loss and gradients on the plain network."""
    plain = _small(net, classes).double().train()
    model = copy.deepcopy(plain)
    report = optimize_memory(model)
    assert report.head is not None, report.head_reason
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 16, 16, 16, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (2, 1, 16, 16, 16), generator=gen).double()
    l0 = DiceCELoss(to_onehot_y=True, softmax=True)(plain(x), y)
    l0.backward()
    with deferred_head(model) as on:
        out = model(x)
    assert on and fused_head.deferred(out) is not None
    assert out.shape == (2, classes, 16, 16, 16) and out.stride() == (0,) * 5  # a placeholder: no memory
    l1 = FusedDiceCELoss()(out, y)
    l1.backward()
    assert abs(float(l1) - float(l0)) <= 1e-9
    for (name, p0), p1 in zip(plain.named_parameters(), model.parameters()):
        assert torch.allclose(p1.grad, p0.grad, rtol=1e-8, atol=1e-12), name


@pytest.mark.parametrize("net", ["unet", "dynunet"])
def test_model_called_normally_gives_the_same_logits(net):
    """Outside deferred_head (validation, inference, the viewer) the head is MONAI's own."""
    plain = _small(net, 3).double()
    model = copy.deepcopy(plain)
    optimize_memory(model)
    x = torch.randn(1, 1, 16, 16, 16, dtype=torch.float64)
    for mode in ("train", "eval"):
        getattr(plain, mode)(), getattr(model, mode)()
        out = model(x)
        assert fused_head.deferred(out) is None
        assert torch.allclose(out, plain(x), rtol=1e-10, atol=1e-12)
    assert model.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad(), deferred_head(model):  # no gradients: nothing to defer to
        assert fused_head.deferred(model(x)) is None


def test_segresnet_head_falls_back_with_a_reason():
    model = _small("segresnet", 3)
    report = optimize_memory(model)
    assert report.head is None and "SegResNet" in report.head_reason
    assert "not fused with the loss" in report.format()
    x, y = torch.randn(1, 1, 16, 16, 16), torch.randint(0, 3, (1, 1, 16, 16, 16)).float()
    with deferred_head(model) as on:
        out = model(x)
    assert not on and fused_head.deferred(out) is None
    FusedDiceCELoss()(out, y).backward()


def test_task_step_loss_uses_the_fused_head(tmp_path):
    from medseg.config import config_from_dict
    from medseg.training.tasks import SegmentationTask

    base = {"task": "segmentation", "data": {"dir": str(tmp_path)}}
    task = SegmentationTask(
        config_from_dict({**base, "train": {"memory": "fused"}}), {0: "bg", 1: "a", 2: "b"}
    )
    model = _small("unet", 3)
    optimize_memory(model)
    calls = []
    model.__dict__["_medseg_head_module"].register_forward_hook(
        lambda m, i, o: calls.append(fused_head.deferred(o))
    )
    x, y = torch.randn(1, 1, 16, 16, 16), torch.randint(0, 3, (1, 1, 16, 16, 16)).float()
    task.step_loss(model, x, y).backward()
    assert calls and calls[0] is not None
    assert fused_head.deferred(model(x)) is None  # the context is left behind


def test_rejects_strided_head():
    conv = nn.Conv3d(4, 3, 3, stride=2, padding=1)
    with pytest.raises(ValueError, match="stride"):
        head_dice_ce(torch.randn(1, 4, 4, 4, 4), conv, False, torch.zeros(1, 1, 2, 2, 2))
