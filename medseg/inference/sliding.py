"""MONAI's sliding-window inference, handed over in finished slabs of the first spatial axis.

What MONAI computes
-------------------
``monai.inferers.sliding_window_inference`` (1.6, no buffering, one image) places windows ``S_w`` of
the ROI size at the starts of ``dense_patch_slices`` (scan interval ``max(1, int(roi * (1 - overlap)))``
per axis, the last start pulled back to the border); their order is that of a C-order ``meshgrid``,
so the *first spatial axis is the outermost loop*. The network runs on batches of ``sw_batch_size``
consecutive windows, ``y_w = f(x[S_w])``, and with the importance map ``g`` (ones, or a separable
Gaussian of sigma = 0.125 x ROI clamped below at ``max(min g, 1e-3)``) it returns, per voxel ``v``,

    out(v) = ( sum_{w: v in S_w} g(v - s_w) y_w(v - s_w) ) / ( sum_{w: v in S_w} g(v - s_w) )      (2)

both sums accumulated in the input's dtype *in window order* (``out[S_w] += g * y_w``,
``count[S_w] += g``), then one division. An input smaller than the ROI is zero-padded
symmetrically first and the output cropped back.

What this module does instead, and why it is the same
-----------------------------------------------------
It visits the same windows in the same order, in the same batches, so each ``y_w`` is the same
tensor. After a batch, let ``s`` be the first-axis start of the next window (windows come sorted by
that start): no later window reaches a row ``x < s``, so rows below ``s`` have all their terms and
are final. Those rows are divided, handed to the caller, and dropped; only rows from there up to
the highest window end seen are kept. Every voxel receives the same additions in the same order, so
the result equals MONAI's bit for bit (``tests/inference/test_infer_scale.py`` compares with ``torch.equal``),
while the buffers hold ``(C + 1) x R x Y x Z`` values instead of ``(C + 1) x X x Y x Z``, with ``R``
(:func:`buffer_rows`) one ROI plus one scan interval for the usual batch sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from monai.data.utils import compute_importance_map, dense_patch_slices, get_valid_patch_size
from monai.inferers.utils import _get_scan_interval


def _geometry(
    spatial: Sequence[int], roi_size: Sequence[int], overlap: float
) -> tuple[tuple[int, ...], list[int], list[tuple[slice, ...]]]:
    """Padded size, MONAI's ``F.pad`` list (last axis first) and the window slices, as MONAI makes them."""
    roi = tuple(int(r) for r in roi_size)
    size = tuple(max(int(n), r) for n, r in zip(spatial, roi))
    pad: list[int] = []
    for k in range(len(spatial) - 1, -1, -1):
        diff = max(roi[k] - int(spatial[k]), 0)
        pad.extend([diff // 2, diff - diff // 2])
    interval = _get_scan_interval(size, roi, len(size), (overlap,) * len(size))
    return size, pad, list(dense_patch_slices(size, roi, interval))


def buffer_rows(spatial: Sequence[int], roi_size: Sequence[int], overlap: float, sw_batch_size: int) -> int:
    """Rows of the first axis that :func:`sliding_window_slabs` keeps at most (its buffers' depth)."""
    size, _, slices = _geometry(spatial, roi_size, overlap)
    base, top, rows = 0, 0, 1
    for g in range(0, len(slices), sw_batch_size):
        batch = slices[g : g + sw_batch_size]
        top = max(top, max(int(s[0].stop) for s in batch))
        rows = max(rows, top - base)
        nxt = int(slices[g + sw_batch_size][0].start) if g + sw_batch_size < len(slices) else size[0]
        base = max(base, nxt)
    return rows


@torch.no_grad()
def sliding_window_slabs(
    inputs: torch.Tensor,
    roi_size: Sequence[int],
    sw_batch_size: int,
    predictor: Callable[[torch.Tensor], torch.Tensor],
    overlap: float = 0.25,
    mode: str = "constant",
    sigma_scale: float = 0.125,
    sw_device: torch.device | str | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(start, block)``: rows ``start:start + block.shape[1]`` of MONAI's (2), in order.

    ``inputs`` is (1, C_in, X, Y, Z). ``block`` is (C, rows, Y, Z) in the input's dtype on ``device``:
    a view into the buffer, final, which the caller may change in place and must not keep past the
    next iteration. Concatenated over the iteration, the blocks equal
    ``sliding_window_inference(inputs, roi_size, sw_batch_size, predictor, overlap, mode,
    sigma_scale, sw_device=sw_device, device=device)[0]`` exactly (see the module docstring).
    """
    if inputs.ndim != 5 or inputs.shape[0] != 1:
        raise ValueError(f"expected one 3D image (1, C, X, Y, Z), got shape {tuple(inputs.shape)}")
    dtype = inputs.dtype
    device = torch.device(device) if device is not None else inputs.device
    sw_device = torch.device(sw_device) if sw_device is not None else inputs.device
    spatial = tuple(inputs.shape[2:])
    roi = tuple(int(r) for r in roi_size)
    size, pad, slices = _geometry(spatial, roi, overlap)
    if any(pad):
        inputs = F.pad(inputs, pad=pad, mode="constant", value=0.0)
    # Crop of each axis back to the unpadded image (MONAI's final slicing).
    lo = [pad[2 * (2 - d)] for d in range(3)]
    weight = compute_importance_map(
        get_valid_patch_size(size, roi), mode=mode, sigma_scale=sigma_scale, device=sw_device, dtype=dtype
    )
    w_t = weight.to(dtype=dtype, device=sw_device)[None, None]
    w_out = w_t.to(device)[0]  # (1, *roi): what each window adds to the count
    rows = buffer_rows(spatial, roi, overlap, sw_batch_size)
    acc: torch.Tensor | None = None
    count = torch.zeros((1, rows, size[1], size[2]), dtype=dtype, device=device)
    base = top = 0  # buffer row 0 is padded row `base`; rows up to `top` hold partial sums
    n = len(slices)
    for g in range(0, n, sw_batch_size):
        batch = slices[g : g + sw_batch_size]
        if len(batch) > 1:
            win = torch.cat([inputs[(slice(0, 1), slice(None), *s)] for s in batch]).to(sw_device)
        else:
            win = inputs[(slice(0, 1), slice(None), *batch[0])].to(sw_device)
        seg = predictor(win)
        seg *= w_t
        seg = seg.to(device)
        if acc is None:
            acc = torch.zeros((seg.shape[1], rows, size[1], size[2]), dtype=dtype, device=device)
        for p, s in zip(seg, batch):
            local = (slice(s[0].start - base, s[0].stop - base), s[1], s[2])
            acc[(slice(None), *local)] += p
            count[(slice(None), *local)] += w_out
            top = max(top, s[0].stop)
        del seg, win
        nxt = slices[g + sw_batch_size][0].start if g + sw_batch_size < n else size[0]
        if nxt <= base:
            continue
        k = nxt - base
        acc[:, :k] /= count[:, :k]
        a, b = max(base, lo[0]), min(nxt, lo[0] + spatial[0])
        if b > a:
            yield (
                a - lo[0],
                acc[:, a - base : b - base, lo[1] : lo[1] + spatial[1], lo[2] : lo[2] + spatial[2]],
            )
        rest = top - nxt
        # Move the unfinished rows to the front, row by row upwards: the destination row i lies below
        # its source k + i and above every source already read, so nothing is overwritten early and no
        # C-channel temporary is made.
        for i in range(max(rest, 0)):
            acc[:, i].copy_(acc[:, k + i])
            count[:, i].copy_(count[:, k + i])
        acc[:, max(rest, 0) :] = 0
        count[:, max(rest, 0) :] = 0
        base = nxt
