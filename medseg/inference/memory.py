"""Segmentation inference whose memory does not grow with the number of classes, and its budget.

:func:`segment` is the segmentation half of :func:`medseg.inference.predict.predict`:

1. sliding-window inference at the model grid with the bundle's window settings (``sw_batch_size``,
   ``overlap``, Gaussian or constant blending), by :func:`medseg.inference.sliding.sliding_window_slabs`: the
   same windows, batches and sums as MONAI's ``sliding_window_inference``, bit for bit, but handed
   over in finished slabs of the model grid's first axis, so the blended logits exist for about one
   window plus one scan interval of rows at a time, never as a ``C x N_model`` volume;
2. softmax over classes in place on each slab, one row at a time (softmax is per voxel, so the
   chunking changes nothing);
3. :class:`medseg.inference.resample.StreamInverter`: each slab of probabilities is interpolated onto the
   input grid and arg-maxed as soon as the input slices that need it are complete, keeping one model
   row from the previous slab; only uint8 labels accumulate (see :mod:`medseg.inference.resample` for the maths
   and the equivalence with ``Invertd`` + argmax). No ``C x N_input`` or ``C x N_model`` array ever
   exists, so the class count enters the peak only through the rolling buffers (``C`` x a few rows).
   A voxel map that mixes axes (sheared input) keeps the whole-grid probabilities and falls back to
   :func:`medseg.inference.resample.invert_argmax` with ``grid_sample``.

Accumulating in float16 would halve step 1's buffers (``ACCUMULATE_DTYPE``); it is not the default
because the buffers are small, and float16 sums of Gaussian weighted logits change labels at near
ties (``medseg bench infer`` counts them).

:func:`estimate` predicts the peak resident memory of a prediction before it starts, and
:func:`check_fits` turns an input that cannot fit into a :class:`medseg.errors.DataError` naming the
numbers instead of an out-of-memory kill.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from monai.data import MetaTensor

from medseg import sysinfo
from medseg.config import Config
from medseg.errors import DataError
from medseg.inference.io import STREAM_SLAB_BYTES, LazyVolume, resample_streamed
from medseg.inference.resample import (
    SLAB_BYTES,
    StreamInverter,
    as_axis_map,
    invert_argmax,
    resample_threads,
    resample_to_model,
    voxel_map,
)
from medseg.inference.sliding import buffer_rows, sliding_window_slabs

log = logging.getLogger(__name__)

#: dtype of the sliding-window accumulators (float32: labels equal to the reference path).
ACCUMULATE_DTYPE = torch.float32
#: Resident bytes of Python, torch and MONAI with a demo-sized model loaded (measured, rounded up).
BASE_BYTES = 450 * 2**20
GB = 2**30


@dataclass
class MemoryEstimate:
    """Predicted peak resident bytes of one prediction, by phase (the input itself included)."""

    input_bytes: int
    preprocess_bytes: int
    stream_bytes: int
    base_bytes: int = BASE_BYTES

    @property
    def peak_bytes(self) -> int:
        return self.base_bytes + self.input_bytes + max(self.preprocess_bytes, self.stream_bytes)


def model_grid_shape(cfg: Config, image: MetaTensor) -> tuple[int, int, int]:
    """Shape of the model grid: each input axis resampled from its spacing to ``transforms.spacing`` (RAS)."""
    affine = np.asarray(image.affine, dtype=np.float64)[:3, :3]
    spacing_in = np.linalg.norm(affine, axis=0)
    ras_axis = np.argmax(np.abs(affine), axis=0)  # world axis each voxel axis runs along mostly
    shape = [0, 0, 0]
    for a, n in enumerate(image.shape[1:4]):
        r = int(ras_axis[a])
        shape[r] = max(1, math.ceil(n * spacing_in[a] / cfg.transforms.spacing[r]))
    return shape[0], shape[1], shape[2]


def estimate(
    cfg: Config, image: MetaTensor, classes: int, accumulate: torch.dtype | None = None
) -> MemoryEstimate:
    """Peak memory of :func:`segment` on ``image``, in bytes, before any of it is allocated.

    With ``N_in`` input voxels, ``N_m = X Y Z`` model-grid voxels and ``C`` classes, beyond the loaded
    input (its own bytes):

    - preprocessing (:func:`model_input`): one slab of float64 work (``SLAB_BYTES / 2``), the model
      input and its windowed copy (``4 + 4`` bytes per model voxel); for a map that is not
      axis-aligned, MONAI's transforms: an oriented copy and a float64 copy of the input (``12 N_in``)
      and ``affine_grid``'s grids (``56`` bytes per model voxel, float64);
    - streaming (sliding window and inversion at once): the model input ``4 N_m``; the rolling sums and
      counts ``(C + 1) R Y Z`` of the accumulate dtype, ``R`` = :func:`medseg.inference.sliding.buffer_rows`
      (about one window plus one scan interval of rows); the windows of one batch and their
      activations; the uint8 labels and the copy handed back (``2 N_in``); one inversion slab
      (``SLAB_BYTES``). The only class-dependent terms are the rolling buffers and the window batch,
      neither of which grows with the volume's length. For a map that is not axis-aligned the
      whole-grid probabilities ``C N_m`` are held as well.

    For a streamed input (a :class:`medseg.inference.io.LazyVolume`) the input term is 0 and
    preprocessing holds one chunk of input slices and its float64 work (``STREAM_SLAB_BYTES``) besides
    the model input, so the peak is ``base + 8 N_m + 2 N_in + (C + 1) R Y Z + ...``: about 2 bytes per
    input voxel plus 8 per model voxel, instead of 6 + 8 with the input loaded as float32.
    """
    acc = torch.finfo(accumulate or ACCUMULATE_DTYPE).bits // 8
    n_in = int(np.prod(image.shape[1:4]))
    grid = model_grid_shape(cfg, image)
    n_m = int(np.prod(grid))
    patch = int(np.prod(cfg.transforms.patch))
    aligned = _axis_aligned(cfg, image)
    rows = buffer_rows(grid, cfg.transforms.patch, cfg.infer.overlap, cfg.infer.sw_batch_size)
    plane = max(grid[1], cfg.transforms.patch[1]) * max(grid[2], cfg.transforms.patch[2])
    # one batch of windows: the network's activations (about 96 bytes per patch voxel for the demo-sized
    # UNet, whatever the class count) and the class maps of its last layers and of the output
    windows = cfg.infer.sw_batch_size * patch * (96 + 8 * (classes + 1))
    stream = 4 * n_m + acc * (classes + 1) * rows * plane + windows + 2 * n_in + SLAB_BYTES
    if isinstance(image, LazyVolume):
        # streamed (medseg.inference.io): nothing of the input is resident but one chunk's slices
        # and their float64 work, bounded by STREAM_SLAB_BYTES; a map that mixes axes loads it whole
        input_bytes = 0 if aligned else (4 + image.stored_itemsize) * n_in
        pre = STREAM_SLAB_BYTES + 8 * n_m if aligned else 12 * n_in + 64 * n_m
    else:
        input_bytes = int(image.element_size() * image.numel())
        pre = SLAB_BYTES // 2 + 8 * n_m if aligned else 12 * n_in + 64 * n_m
    return MemoryEstimate(
        input_bytes=input_bytes,
        preprocess_bytes=pre,
        stream_bytes=stream if aligned else stream + 4 * classes * n_m,
    )


def _axis_aligned(cfg: Config, image: MetaTensor) -> bool:
    """Whether the input-to-model voxel map is a scaled permutation (then no MONAI copies are made).

    Orientation permutes and flips axes and Spacing rescales them keeping their directions, so the
    map is a scaled permutation whenever the input's axes are orthogonal (oblique ones included).
    """
    affine = np.asarray(image.affine, dtype=np.float64)[:3, :3]
    cols = affine / np.linalg.norm(affine, axis=0)
    return bool(np.allclose(cols.T @ cols, np.eye(3), atol=1e-6))


def check_fits(est: MemoryEstimate, name: str, available: int | None = None) -> None:
    """Raise DataError when the predicted peak exceeds what this process can still allocate.

    The input and the libraries are already resident, so only what the prediction allocates beyond
    them must fit into ``available`` (default :func:`medseg.sysinfo.available_memory`).
    """
    need = est.peak_bytes - est.base_bytes - est.input_bytes
    avail = sysinfo.available_memory() if available is None else available
    log.debug(
        "predicted peak %.2f GB, %.2f GB more needed, %.2f GB available",
        est.peak_bytes / GB,
        need / GB,
        avail / GB,
    )
    if need > avail:
        raise DataError(
            f"{name}: inference would need about {est.peak_bytes / GB:.1f} GB at its peak "
            f"({need / GB:.1f} GB more than now) but only {avail / GB:.1f} GB are available; "
            "free memory, use a machine with more, or crop the volume to the region of interest"
        )


def model_input(cfg: Config, image: MetaTensor) -> tuple[torch.Tensor, np.ndarray]:
    """The network's input (1, X, Y, Z) float32 and its affine, as :func:`medseg.training.transforms.preprocess` makes them.

    The geometry (model-grid shape and affine) comes from MONAI's own ``Orientation`` and ``Spacing``
    run lazily on a zero-stride stand-in, so it is theirs exactly; the samples come from
    :func:`medseg.inference.resample.resample_to_model` (float64 like ``Spacing``, in slabs, no copy of the input)
    and are normalised by :func:`medseg.training.transforms.intensity_array` (``transforms.normalize``). A map that is not axis-aligned falls back to
    MONAI's transforms.
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
