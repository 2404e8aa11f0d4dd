"""Class-count-independent inversion of a segmentation onto the input grid, in slabs.

The reference: ``Invertd``, then argmax
---------------------------------------
Preprocessing is ``Orientationd(RAS)`` then ``Spacingd(bilinear, padding border)``. ``Invertd``
undoes it on the class probabilities ``p_c`` (C maps on the model grid): it resamples them with
trilinear interpolation onto the (oriented) input grid, flips/permutes back, and the label is
``argmax_c`` there. For an input voxel ``v`` with model-grid coordinate ``u = M v`` the label is

    L(v) = argmax_c  sum_{k in corners(u)} w_k(u) p_c(x_k)                                   (1)

with the 8 trilinear corner weights ``w_k`` (coordinates clamped to ``[0, n-1]`` per axis: border
padding). ``M = A_model^-1 A_input`` maps input voxel indices to model voxel indices. Orientation is
an exact flip/permutation and Spacing keeps the direction cosines and rescales each axis
(``zoom_affine``), so ``M`` is a *scaled permutation* plus a translation: input axis ``a`` reads model
axis ``perm[a]`` at ``u = scale[a] * i_a + offset[a]``.

Equivalences used
-----------------
- (1) is independent across voxels: evaluating it on slabs of input voxels and writing each slab's
  argmax gives the same labels as evaluating it on the whole grid at once. Only ``C x slab`` floats
  are alive at a time, never ``C x input voxels``.
- Because ``M`` is separable, the trilinear weights factor, ``w_k = w^(0) w^(1) w^(2)``, so (1) is
  three successive 1-D linear interpolations (one per axis) of the same corner values; the sum is
  equal in exact arithmetic, and the float32 results differ from ``grid_sample``'s by rounding only
  (about 1e-7 relative). Labels can therefore differ only where two classes' interpolated
  probabilities are equal to within rounding; the tests and the benchmark count such voxels.
- The argmax at the model grid followed by a nearest-label resample is *not* equivalent (it gives
  other borders), so it is not used.

The forward direction
---------------------
``Spacingd`` resamples in float64 (its default ``dtype``): it copies the whole input to float64 and,
for a stored-LPS CT, ``Orientationd`` copies it once more first. :func:`resample_to_model` computes
the same trilinear samples (border padding) in float64 slab by slab, straight from the input as
stored (any dtype, never copied whole), and rounds them to float32 as ``Spacingd`` does. The
float64 results differ from ``grid_sample``'s by about 1e-16 relative, so the float32 model input
is equal but for an occasional last-bit rounding; the label tests compare the end result.

An ``M`` that is not a scaled permutation (a sheared input affine) falls back to the same slabbed
evaluation of (1) with ``torch.nn.functional.grid_sample`` and the full 3x4 map.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

#: Bytes of float32 working memory one slab may use (the slab size is chosen from it).
SLAB_BYTES = 256 * 2**20


@dataclass(frozen=True)
class AxisMap:
    """Input axis ``a`` reads model axis ``perm[a]`` at ``scale[a] * i + offset[a]`` (voxel units)."""

    perm: tuple[int, int, int]
    scale: tuple[float, float, float]
    offset: tuple[float, float, float]


def voxel_map(model_affine: np.ndarray, input_affine: np.ndarray) -> np.ndarray:
    """``M = A_model^-1 A_input`` (4x4, float64): input voxel index -> model-grid voxel coordinate."""
    return np.linalg.solve(np.asarray(model_affine, np.float64), np.asarray(input_affine, np.float64))


def as_axis_map(m: np.ndarray, tol: float = 1e-6) -> AxisMap | None:
    """The scaled-permutation form of ``m``, or None when ``m`` mixes axes (sheared or oblique map)."""
    lin = m[:3, :3]
    perm = tuple(int(np.argmax(np.abs(lin[:, a]))) for a in range(3))
    if sorted(perm) != [0, 1, 2]:
        return None
    for a in range(3):
        col = lin[:, a].copy()
        big = abs(col[perm[a]])
        col[perm[a]] = 0.0
        if big == 0.0 or np.abs(col).max() > tol * max(big, 1.0):
            return None
    return AxisMap(
        perm=perm,  # type: ignore[arg-type]
        scale=tuple(float(lin[perm[a], a]) for a in range(3)),  # type: ignore[arg-type]
        offset=tuple(float(m[perm[a], 3]) for a in range(3)),  # type: ignore[arg-type]
    )


def axis_weights(
    n_out: int, n_src: int, scale: float, offset: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """Lower/upper source index and weight of the upper one for each of ``n_out`` output indices.

    Coordinates are clamped to ``[0, n_src - 1]`` (``grid_sample``'s border padding, as Spacingd).
    """
    u = torch.arange(n_out, dtype=torch.float64) * scale + offset
    u = u.clamp(0.0, float(n_src - 1))
    lo = u.floor()
    w = (u - lo).to(dtype)
    lo_i = lo.long()
    hi_i = (lo_i + 1).clamp(max=n_src - 1)
    return lo_i, hi_i, w


def lerp_axis(
    x: torch.Tensor,
    dim: int,
    lo: torch.Tensor,
    hi: torch.Tensor,
    w: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Linear interpolation of ``x`` along ``dim`` at the given index pairs and weights (in ``w``'s dtype)."""
    dtype = dtype or w.dtype
    a = x.index_select(dim, lo).to(dtype)
    b = x.index_select(dim, hi).to(dtype)
    shape = [1] * x.ndim
    shape[dim] = -1
    return a.lerp_(b, w.view(shape))


def argmax_first(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(0)`` as uint8, by a running maximum over classes (C passes, no int64 array).

    Strictly greater replaces the running best, so ties go to the lowest class, as ``torch.argmax``.
    """
    best = x[0].clone()
    idx = torch.zeros(x.shape[1:], dtype=torch.uint8)
    for c in range(1, x.shape[0]):
        idx.masked_fill_(x[c] > best, c)
        torch.maximum(best, x[c], out=best)
    return idx


def slab_size(channels: int, plane_voxels: int, budget: int = SLAB_BYTES) -> int:
    """Input slices per slab so that about three ``C x slab`` float32 buffers fit in ``budget``."""
    return max(1, budget // max(1, 3 * 4 * channels * plane_voxels))


@torch.no_grad()
def invert_argmax(
    probs: torch.Tensor,
    m: np.ndarray,
    out_shape: tuple[int, int, int],
    slab: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> torch.Tensor:
    """Labels ``argmax_c`` of ``probs`` (C, X, Y, Z) trilinearly resampled onto ``out_shape``, by (1).

    ``m`` maps output voxel indices to ``probs`` voxel coordinates. Returns (I, J, K) uint8. Work is
    done in slabs of input axis 0; torch's intra-op threads share each slab's interpolation.
    """
    if probs.shape[0] > 256:
        raise ValueError(f"{probs.shape[0]} classes do not fit a uint8 label map")
    probs = probs.as_tensor() if hasattr(probs, "as_tensor") else probs  # a MetaTensor's data
    n_i, n_j, n_k = out_shape
    slab = slab or slab_size(probs.shape[0], n_j * n_k)
    out = torch.empty(out_shape, dtype=torch.uint8)
    amap = as_axis_map(m)
    if amap is None:
        log.info("inversion: the voxel map mixes axes; using grid_sample in slabs")
    else:
        # Put the model axes in input-axis order (a view), then interpolate axis by axis.
        q = probs.permute(0, *(1 + p for p in amap.perm))
        axes = [
            axis_weights(n, q.shape[1 + a], amap.scale[a], amap.offset[a]) for a, n in enumerate(out_shape)
        ]
    for start in range(0, n_i, slab):
        stop = min(n_i, start + slab)
        if amap is None:
            out[start:stop] = argmax_first(_grid_sample_slab(probs.float(), m, start, stop, n_j, n_k))
        else:
            # Every gather is along dim 1 of a contiguous array (whole rows copied, index_select's fast
            # case); the axes are rotated between steps and the labels rotated back at the end.
            lo, hi, w = (t[start:stop] for t in axes[0])
            block = lerp_axis(q, 1, lo, hi, w)  # (C, s, Y, Z)
            block = lerp_axis(block.permute(0, 2, 1, 3).contiguous(), 1, *axes[1])  # (C, J, s, Z)
            block = lerp_axis(block.permute(0, 3, 1, 2).contiguous(), 1, *axes[2])  # (C, K, J, s)
            out[start:stop] = argmax_first(block).permute(2, 1, 0)
            del block
        if progress:
            progress(stop / n_i)
    return out


class StreamInverter:
    """(1) evaluated while the model grid arrives in slabs of its first axis (see ``medseg.inference.sliding``).

    Input axis ``a0`` reads model axis 0 at ``u = scale * i + offset``; input index ``i`` needs model rows
    ``lo_i = floor(u)`` and ``hi_i = min(lo_i + 1, X - 1)`` (``u`` clamped to ``[0, X - 1]``). Both are
    monotone in ``i``, so taking input indices by increasing ``lo``, index ``i`` can be computed as soon
    as rows up to ``hi_i`` have arrived, and needs nothing below ``hi_i - 1``: keeping the last row of
    the previous slab is enough. Each voxel's value is (1) computed from the same corner values and
    weights in the same order as :func:`invert_argmax` (model axis 0 first), so when ``a0 = 0`` the
    labels are those of :func:`invert_argmax` on the whole probability volume.

    Probability slabs are fed with :meth:`feed` in order; :meth:`result` returns the (I, J, K) uint8
    labels once every model row has arrived. Work is cut into input slabs of :func:`slab_size`.
    """

    def __init__(
        self,
        m: np.ndarray,
        model_shape: tuple[int, int, int],
        out_shape: tuple[int, int, int],
        budget: int = SLAB_BYTES,
    ) -> None:
        amap = as_axis_map(m)
        if amap is None:
            raise ValueError("StreamInverter needs an axis-aligned map (a scaled permutation)")
        self.perm = amap.perm
        self.a0, self.a1, self.a2 = (amap.perm.index(k) for k in range(3))
        self.out_shape = tuple(int(n) for n in out_shape)
        self.axes = [
            axis_weights(self.out_shape[a], int(model_shape[amap.perm[a]]), amap.scale[a], amap.offset[a])
            for a in range(3)
        ]
        lo0, hi0, _ = self.axes[self.a0]
        self.descending = bool(len(lo0) > 1 and lo0[0] > lo0[-1])
        # Input indices along a0 by increasing lo (ties keep index order), and their hi.
        self.order = torch.arange(len(lo0) - 1, -1, -1) if self.descending else torch.arange(len(lo0))
        self.hi_sorted = hi0[self.order]
        self.lo_sorted = lo0[self.order]
        self.done = 0
        self.rows = int(model_shape[0])
        self.budget = budget
        self.carry: torch.Tensor | None = None
        self.carry_row = -1
        self.out = torch.empty(self.out_shape, dtype=torch.uint8)
        # labels come out with axes (a2, a1, a0); this puts them back in input order
        self.back = tuple((self.a2, self.a1, self.a0).index(d) for d in range(3))

    @property
    def finished(self) -> bool:
        return self.done == len(self.order)

    @torch.no_grad()
    def feed(self, start: int, block: torch.Tensor) -> None:
        """Probabilities (C, rows, Y, Z) of model rows ``start:start + rows``, the next rows in order."""
        if block.shape[0] > 256:
            raise ValueError(f"{block.shape[0]} classes do not fit a uint8 label map")
        stop = start + block.shape[1]
        ready = int(torch.searchsorted(self.hi_sorted, stop, side="left"))
        # Indices whose lower row is the previous slab's last: a two-row source (carry, first row),
        # so that the slab itself is never copied whole.
        need_carry = min(ready, int(torch.searchsorted(self.lo_sorted, start, side="left")))
        if need_carry > self.done:
            if self.carry is None or self.carry_row != start - 1:  # pragma: no cover - rows come in order
                raise RuntimeError("inversion needs a model row that has already been dropped")
            self._emit(need_carry, torch.cat([self.carry, block[:, :1]], 1), start - 1)
        self._emit(ready, block, start)
        self.carry = block[:, -1:].clone()
        self.carry_row = stop - 1

    def _emit(self, ready: int, src: torch.Tensor, first: int) -> None:
        """Labels of the input indices ``order[done:ready]`` from model rows ``first:first + src.shape[1]``."""
        slab = slab_size(src.shape[0], self.out_shape[self.a1] * self.out_shape[self.a2], self.budget)
        lo0, hi0, w0 = self.axes[self.a0]
        while self.done < ready:
            take = self.order[self.done : min(ready, self.done + slab)]
            i0 = int(take.min())
            idx = torch.arange(i0, i0 + len(take))
            block = lerp_axis(src, 1, lo0[idx] - first, hi0[idx] - first, w0[idx])  # (C, s, Y, Z)
            block = lerp_axis(block.permute(0, 2, 1, 3).contiguous(), 1, *self.axes[self.a1])
            block = lerp_axis(block.permute(0, 3, 1, 2).contiguous(), 1, *self.axes[self.a2])
            self.out.narrow(self.a0, i0, len(take)).copy_(argmax_first(block).permute(*self.back))
            del block
            self.done += len(take)

    def result(self) -> torch.Tensor:
        if not self.finished:
            raise RuntimeError(f"inversion incomplete: {self.done} of {len(self.order)} input slices")
        return self.out


@torch.no_grad()
def resample_to_model(
    image: torch.Tensor, m: np.ndarray, out_shape: tuple[int, int, int], budget: int = SLAB_BYTES // 2
) -> torch.Tensor:
    """``image`` (C, I, J, K), any dtype, trilinearly resampled (float64, border) onto ``out_shape``.

    ``m`` maps output (model-grid) voxel indices to input voxel coordinates and must be a scaled
    permutation (:func:`as_axis_map`). Returns (C, X, Y, Z) float32; works in slabs of output axis 0,
    so that beyond the output only one slab's float64 work is alive.
    """
    amap = as_axis_map(m)
    if amap is None:
        raise ValueError("resample_to_model needs an axis-aligned map")
    q = image.permute(0, *(1 + p for p in amap.perm))
    axes = [
        axis_weights(n, q.shape[1 + a], amap.scale[a], amap.offset[a], torch.float64)
        for a, n in enumerate(out_shape)
    ]
    c, (n_x, n_y, n_z) = image.shape[0], out_shape
    out = torch.empty((c, n_x, n_y, n_z), dtype=torch.float32)
    plane = c * q.shape[2] * q.shape[3] * 8 * 3
    slab = max(1, budget // max(1, plane))
    for start in range(0, n_x, slab):
        stop = min(n_x, start + slab)
        lo, hi, w = (t[start:stop] for t in axes[0])
        block = lerp_axis(q, 1, lo, hi, w, torch.float64)
        block = lerp_axis(block, 2, *axes[1])
        block = lerp_axis(block, 3, *axes[2])
        out[:, start:stop] = block
    return out


def _grid_sample_slab(
    probs: torch.Tensor, m: np.ndarray, start: int, stop: int, n_j: int, n_k: int
) -> torch.Tensor:
    """(1) for input rows ``start:stop`` with the general map ``m`` (border padding, align_corners=False)."""
    ii, jj, kk = torch.meshgrid(
        torch.arange(start, stop, dtype=torch.float64),
        torch.arange(n_j, dtype=torch.float64),
        torch.arange(n_k, dtype=torch.float64),
        indexing="ij",
    )
    mt = torch.as_tensor(m, dtype=torch.float64)
    coords = [mt[r, 0] * ii + mt[r, 1] * jj + mt[r, 2] * kk + mt[r, 3] for r in range(3)]
    sizes = probs.shape[1:]
    # grid_sample wants (x, y, z) = (last, middle, first) axis, normalised for align_corners=False.
    grid = torch.stack([(2 * coords[r] + 1) / sizes[r] - 1 for r in (2, 1, 0)], -1).float()
    out = torch.nn.functional.grid_sample(
        probs[None], grid[None], mode="bilinear", padding_mode="border", align_corners=False
    )
    return out[0]


def resample_threads() -> int:
    """Intra-op threads for resampling: every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
