"""Segmentation inference whose memory does not grow with the number of classes.

:func:`segment` is the segmentation half of :func:`medseg.inference.predict.predict`. It builds the
model input with :func:`model_input` (whole input, or read in slabs from a
:class:`medseg.inference.io.LazyVolume`), then:

1. sliding-window inference at the model grid with the bundle's window settings (``sw_batch_size``,
   ``overlap``, Gaussian or constant blending), by
   :func:`medseg.inference.sliding.sliding_window_slabs`: the same windows, batches and sums as
   MONAI's ``sliding_window_inference``, bit for bit, but handed over in finished slabs of the model
   grid's first axis, so the blended logits exist for about one window plus one scan interval of
   rows at a time, never as a ``C x N_model`` volume;
2. softmax over classes in place on each slab, one row at a time (softmax is per voxel, so the
   chunking changes nothing);
3. :class:`medseg.inference.resample.StreamInverter`: each slab of probabilities is interpolated onto
   the input grid and arg-maxed as soon as the input slices that need it are complete, keeping one
   model row from the previous slab; only uint8 labels accumulate (see :mod:`medseg.inference.resample`
   for the maths and the equivalence with ``Invertd`` + argmax). No ``C x N_input`` or
   ``C x N_model`` array ever exists, so the class count enters the peak only through the rolling
   buffers (``C`` x a few rows). A voxel map that mixes axes (sheared input) keeps the whole-grid
   probabilities and falls back to :func:`medseg.inference.resample.invert_argmax` with
   ``grid_sample``.

Accumulating in float16 would halve step 1's buffers (``ACCUMULATE_DTYPE``); it is not the default
because the buffers are small, and float16 sums of Gaussian weighted logits change labels at near
ties (``medseg bench infer`` counts them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import combinations

import numpy as np
import torch
from monai.data import MetaTensor

from medseg.config import Config
from medseg.inference.io import LazyVolume, resample_streamed
from medseg.inference.resample import (
    StreamInverter,
    as_axis_map,
    invert_argmax,
    resample_threads,
    resample_to_model,
    voxel_map,
)
from medseg.inference.sliding import sliding_window_slabs

log = logging.getLogger(__name__)

#: dtype of the sliding-window accumulators (float32: labels equal to the reference path).
ACCUMULATE_DTYPE = torch.float32


def model_input(cfg: Config, image: MetaTensor) -> tuple[torch.Tensor, np.ndarray]:
    """The network's input (1, X, Y, Z) float32 and its affine, as
    :func:`medseg.training.transforms.preprocess` makes them.

    The geometry (model-grid shape and affine) comes from MONAI's own ``Orientation`` and ``Spacing``
    run lazily on a zero-stride stand-in, so it is theirs exactly; the samples come from
    :func:`medseg.inference.resample.resample_to_model` (float64 like ``Spacing``, in slabs, no copy
    of the input), or from :func:`medseg.inference.io.resample_streamed` for a
    :class:`medseg.inference.io.LazyVolume`, and are normalised by
    :func:`medseg.training.transforms.intensity_array` (``transforms.normalize``). A map that is not
    axis-aligned falls back to MONAI's transforms.
    """

    from monai import transforms as mt

    from medseg.training import transforms as tf

    t = cfg.transforms
    stub = MetaTensor(torch.zeros(1, 1, 1, 1).expand(*image.shape), affine=image.affine)
    lazy = mt.Spacing(pixdim=t.spacing, mode="bilinear", lazy=True)(
        mt.Orientation(axcodes="RAS", lazy=True)(stub)
    )
    affine = np.asarray(lazy.peek_pending_affine(), dtype=np.float64)
    shape = tuple(int(n) for n in lazy.peek_pending_shape())
    m = voxel_map(np.asarray(image.affine, dtype=np.float64), affine)
    lazy_input = isinstance(image, LazyVolume)
    if as_axis_map(m) is None:
        if lazy_input:
            log.info("%s: the voxel map mixes axes; loading the whole input", image.path)
            image = image.load()
        data = tf.preprocess(cfg)({"image": image})["image"]
        return data.as_tensor(), np.asarray(data.affine, dtype=np.float64)
    if lazy_input:
        x = resample_streamed(image, m, shape)
    else:
        x = resample_to_model(image.as_tensor() if isinstance(image, MetaTensor) else image, m, shape)
    x = tf.intensity_array(cfg)(x)
    return (x.as_tensor() if isinstance(x, MetaTensor) else x), affine


def mirror_averaged(
    forward: Callable[[torch.Tensor], torch.Tensor], axes: list[int]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Test-time mirroring (``infer.mirror``): the mean of the logits over every flip of ``axes``.

    With F_S the flip of the spatial axes S of a (B, C, X, Y, Z) batch, the mirrored forward is
    f_m(x) = 2^-|A| sum_{S subset of A} F_S(f(F_S(x))), A = ``axes`` (nnU-Net's 8 flips for A = {0, 1, 2}).
    Each F_S is its own inverse, so every term is a prediction on ``x``'s own grid.
    """
    if not axes:
        return forward
    flips = [tuple(a + 2 for a in combo) for r in range(len(axes) + 1) for combo in combinations(axes, r)]

    def averaged(patch: torch.Tensor) -> torch.Tensor:
        total = forward(patch)
        for dims in flips[1:]:
            total = total + torch.flip(forward(torch.flip(patch, dims)), dims)
        return total / len(flips)

    return averaged


def _softmax_rows_(block: torch.Tensor) -> None:
    """Softmax over classes (dim 0) in place, one first-axis row at a time (per voxel: rows change nothing)."""
    for r in range(block.shape[1]):
        row = block[:, r]
        row.copy_(torch.softmax(row.float(), 0))


@torch.no_grad()
def segment(
    model: torch.nn.Module,
    cfg: Config,
    image: MetaTensor,
    device: torch.device,
    progress: Callable[[float], None] | None = None,
    accumulate: torch.dtype | None = None,
) -> torch.Tensor:
    """Labels (I, J, K) uint8 on ``image``'s grid; see the module docstring for the steps."""
    acc = accumulate or ACCUMULATE_DTYPE
    x, model_affine = model_input(cfg, image)
    model_shape = tuple(int(n) for n in x.shape[1:4])
    x = x[None].to(device)
    if acc != torch.float32:
        x = x.to(acc)

    def forward(patch: torch.Tensor) -> torch.Tensor:
        return model(patch.float()).to(acc)

    inf = cfg.infer
    forward = mirror_averaged(forward, inf.mirror)
    use_amp = device.type == "cuda" and cfg.train.amp
    m = voxel_map(model_affine, np.asarray(image.affine, dtype=np.float64))
    out_shape = tuple(int(n) for n in image.shape[1:4])
    inverter = StreamInverter(m, model_shape, out_shape) if as_axis_map(m) is not None else None
    probs: torch.Tensor | None = None  # the whole model grid, only for a map that mixes axes
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, resample_threads()))
    try:
        with torch.autocast(device.type, enabled=use_amp):
            slabs = sliding_window_slabs(
                x,
                cfg.transforms.patch,
                inf.sw_batch_size,
                forward,
                overlap=inf.overlap,
                mode=inf.mode,
                sw_device=device,
                device="cpu",
            )
            for start, block in slabs:
                _softmax_rows_(block)
                if inverter is not None:
                    inverter.feed(start, block)
                else:
                    if probs is None:
                        probs = torch.empty((block.shape[0], *model_shape), dtype=block.dtype)
                    probs[:, start : start + block.shape[1]] = block
                if progress:
                    progress(0.95 * (start + block.shape[1]) / model_shape[0])
        del x
        if inverter is not None:
            label = inverter.result()
        else:
            log.info("inversion: the voxel map mixes axes; whole-grid probabilities, grid_sample in slabs")
            assert probs is not None
            label = invert_argmax(probs, m, out_shape)
    finally:
        torch.set_num_threads(threads)
    return label
