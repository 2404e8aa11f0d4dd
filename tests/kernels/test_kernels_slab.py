"""Narrow-input convolutions in depth slabs: same values and gradients as nn.Conv3d, less peak."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from medseg.kernels import slab
from medseg.kernels.slab import SlabConv, slice_narrow_convs


@pytest.mark.parametrize(
    "cin,stride,padding,depth",
    [(1, 1, 1, 24), (1, 2, 1, 24), (3, 1, 1, 19), (2, 2, 0, 21), (3, 1, (1, 0, 2), 16)],
)
def test_slab_conv_equals_conv3d(cin, stride, padding, depth, monkeypatch):
    monkeypatch.setattr(slab, "SLAB_VOXELS", 256)  # several slabs even on a small volume
    torch.manual_seed(0)
    conv = nn.Conv3d(cin, 5, 3, stride=stride, padding=padding).double()
    sliced = copy.deepcopy(conv)
    assert slice_narrow_convs(sliced) == [""] and isinstance(sliced, SlabConv)
    ds = (depth - 2 + 2 * (padding if isinstance(padding, int) else padding[0])) // stride
    assert len(slab._slabs(ds, 100, 2)) > 1
    x = torch.randn(2, cin, depth, 10, 9, dtype=torch.double, requires_grad=True)
    y0, y1 = conv(x), sliced(x)
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-12)
    g = torch.randn_like(y0)
    for a, b in zip(
        torch.autograd.grad(y0, [x, *conv.parameters()], g),
        torch.autograd.grad(y1, [x, *sliced.parameters()], g),
    ):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert sliced.state_dict().keys() == conv.state_dict().keys()


def test_only_narrow_plain_convolutions_are_sliced():
    model = nn.Sequential(nn.Conv3d(1, 8, 3, padding=1), nn.Conv3d(8, 16, 3, padding=1), nn.Conv3d(16, 3, 1))
    model.add_module("t", nn.ConvTranspose3d(3, 3, 2, stride=2))
    model.add_module("g", nn.Conv3d(4, 4, 3, groups=2))
    assert slice_narrow_convs(model) == ["0"]
