"""The peak memory of a segmentation, predicted before it starts, and the check that it fits.

:func:`estimate` predicts the peak resident memory of :func:`medseg.inference.segment.segment` on an
input (loaded, or streamed from a :class:`medseg.inference.io.LazyVolume`) from its shape, the model
grid and the bundle's window settings; :func:`check_fits` turns an input that cannot fit into a
:class:`medseg.errors.DataError` naming the numbers instead of an out-of-memory kill.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from monai.data import MetaTensor

from medseg import sysinfo
from medseg.config import Config
from medseg.errors import DataError
from medseg.inference import segment as segmentation
from medseg.inference.io import STREAM_SLAB_BYTES, LazyVolume
from medseg.inference.resample import SLAB_BYTES
from medseg.inference.sliding import buffer_rows

log = logging.getLogger(__name__)

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
    """Peak memory of :func:`medseg.inference.segment.segment` on ``image``, in bytes, before any of it
    is allocated.

    With ``N_in`` input voxels, ``N_m = X Y Z`` model-grid voxels and ``C`` classes, beyond the loaded
    input (its own bytes):

    - preprocessing (:func:`medseg.inference.segment.model_input`): one slab of float64 work
      (``SLAB_BYTES / 2``), the model input and its windowed copy (``4 + 4`` bytes per model voxel);
      for a map that is not axis-aligned, MONAI's transforms: an oriented copy and a float64 copy of
      the input (``12 N_in``) and ``affine_grid``'s grids (``56`` bytes per model voxel, float64);
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
    acc = torch.finfo(accumulate or segmentation.ACCUMULATE_DTYPE).bits // 8
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
