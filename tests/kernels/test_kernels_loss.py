"""Fused Dice + CE loss: equality with MONAI's DiceCELoss, gradcheck, saved bytes, label checks."""

from __future__ import annotations

import itertools

import pytest
import torch
from monai.losses import DiceCELoss

from medseg.kernels import dice_ce, native
from medseg.kernels.dice_ce import DiceCEReference
from medseg.kernels.loss import FusedDiceCELoss

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
TOL = {torch.float64: 1e-9, torch.float32: 1e-5}


@pytest.fixture(params=["native", "reference"])
def backend(request, monkeypatch):
    """Run on the native kernels (CPU, or CUDA when built with it) and on the PyTorch reference."""
    if request.param == "reference":
        monkeypatch.setattr(dice_ce, "ops_for", lambda x: DiceCEReference)
    return request.param


def _case(classes: int, dtype: torch.dtype, device: str, shape=(2, 6, 5, 7), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(shape[0], classes, *shape[1:], generator=gen, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, classes, (shape[0], 1, *shape[1:]), generator=gen).to(torch.float32)
    if classes > 3:  # an absent class: its Dice term is smooth-only, as in MONAI
        labels[labels == 2] = 1
    return logits.to(device).requires_grad_(True), labels.to(device)


def _monai_and_fused(logits, labels, include_background: bool):
    ref = DiceCELoss(to_onehot_y=True, softmax=True, include_background=include_background)
    x0 = logits.detach().clone().requires_grad_(True)
    l0 = ref(x0, labels)
    (g0,) = torch.autograd.grad(l0, x0)
    x1 = logits.detach().clone().requires_grad_(True)
    l1 = FusedDiceCELoss(include_background=include_background)(x1, labels)
    (g1,) = torch.autograd.grad(l1, x1)
    return l0, g0, l1, g1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("classes,include_background", list(itertools.product([2, 3, 14], [True, False])))
def test_equals_monai_dicece(classes, include_background, dtype, device, backend):
    logits, labels = _case(classes, dtype, device)
    l0, g0, l1, g1 = _monai_and_fused(logits, labels, include_background)
    tol = TOL[dtype]
    assert l1.dtype == l0.dtype
    assert abs(float(l1) - float(l0)) <= tol * max(1.0, abs(float(l0))), (float(l1), float(l0))
    # gradients are O(1/(N S)); compare against the gradient's own scale
    err = float((g1 - g0).abs().max()) / float(g0.abs().max())
    assert err <= tol, err


@pytest.mark.parametrize("device", DEVICES)
def test_larger_volume_several_tasks_matches_monai(device, backend):
    """More voxels than one CPU task (4096) and one CUDA block, 14 classes, float32."""
    logits, labels = _case(14, torch.float32, device, shape=(2, 24, 20, 18), seed=1)
    l0, g0, l1, g1 = _monai_and_fused(logits, labels, include_background=False)
    assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0))
    assert float((g1 - g0).abs().max()) <= 1e-5 * float(g0.abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("include_background", [True, False])
def test_gradcheck(include_background, device, backend):
    logits, labels = _case(3, torch.float64, device, shape=(2, 3, 2, 3))
    loss = FusedDiceCELoss(include_background=include_background, lambda_dice=0.7, lambda_ce=1.3)
    assert torch.autograd.gradcheck(lambda x: loss(x, labels), (logits,))


@pytest.mark.parametrize("device", DEVICES)
def test_int32_labels_beyond_255_classes(device, backend):
    logits, labels = _case(260, torch.float64, device, shape=(1, 4, 3, 2))
    assert dice_ce.label_tensor(labels, 260).dtype == torch.int32
    l0, g0, l1, g1 = _monai_and_fused(logits, labels, include_background=True)
    assert abs(float(l1) - float(l0)) <= 1e-9
    assert float((g1 - g0).abs().max()) <= 1e-9 * float(g0.abs().max())


def test_saves_only_logits_and_uint8_labels():
    logits, labels = _case(14, torch.float32, "cpu", shape=(2, 16, 16, 16))
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        FusedDiceCELoss()(logits, labels)
    voxels = 2 * 16**3
    big = sorted(v for v in seen.values() if v >= voxels)
    assert big == [voxels, logits.numel() * 4], big  # uint8 labels and the logits, nothing else full-size
    assert sum(seen.values()) - sum(big) <= 4 * 2 * 14 * 8  # (N, C) coefficients


@pytest.mark.parametrize(
    "bad", [lambda y: y.add(0.5), lambda y: y.fill_(14), lambda y: y.fill_(-1)], ids=["fraction", "14", "-1"]
)
def test_labels_must_be_integers_in_range(bad):
    logits, labels = _case(14, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="labels must be integers"):
        FusedDiceCELoss()(logits, bad(labels.clone()))


def test_native_kernel_counts_out_of_range_labels():
    mod = native.load()
    if mod is None:
        pytest.skip("native kernels not built")
    x = torch.randn(1, 3, 10)
    y = torch.tensor([[0, 1, 2, 3, 200, 0, 1, 2, 1, 0]], dtype=torch.uint8)
    _, ce = mod.dice_ce_forward(x, y)
    assert float(ce[0, 1]) == 2


@pytest.mark.parametrize(
    "kwargs", [{"sigmoid": True}, {"batch": True}, {"squared_pred": True}, {"weight": torch.ones(3)}]
)
def test_unsupported_options_say_so(kwargs):
    with pytest.raises(NotImplementedError, match="use monai.losses.DiceCELoss"):
        FusedDiceCELoss(**kwargs)


def test_native_backend_is_used_when_built():
    if native.load() is None:
        pytest.skip("native kernels not built")
    x = torch.randn(1, 2, 4)
    assert dice_ce.ops_for(x) is not DiceCEReference


def test_task_uses_fused_loss_with_train_memory_fused(tmp_path):
    from medseg.config import config_from_dict
    from medseg.training.tasks import SegmentationTask

    base = {"task": "segmentation", "data": {"dir": str(tmp_path)}}
    fused = SegmentationTask(config_from_dict({**base, "train": {"memory": "fused"}}), {0: "bg", 1: "fg"})
    plain = SegmentationTask(config_from_dict(base), {0: "bg", 1: "fg"})
    assert isinstance(fused.loss, FusedDiceCELoss)
    assert isinstance(plain.loss, DiceCELoss)
