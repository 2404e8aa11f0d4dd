"""Reading inputs: NIfTI files and DICOM series loaded whole, or big NIfTI files opened for streaming.

:func:`load_image` reads a NIfTI file or a DICOM series folder into a channel-first MetaTensor in its
own geometry. Above a size threshold (:data:`STREAM_VOXELS` input voxels; ``medseg infer
--stream-above``, or the ``MEDSEG_STREAM_VOXELS`` environment variable) a 3D NIfTI file is not
loaded: :func:`load_image` returns a :class:`LazyVolume`, the NIfTI header and nibabel's array
proxy, nothing else. :func:`medseg.inference.segment.model_input` then builds the model input from
it with :func:`resample_streamed` (the input is read slab by slab and never held whole); the
sliding window and the inversion are those of a loaded input.

What is held, and what is not
-----------------------------
The loaded path holds the input as float32 (4 bytes per input voxel, after nibabel's stored-dtype
array: 2 more for int16) for the whole prediction. The streaming path holds only

- the rolling window of input slices that the current chunk of the model grid needs (float32, the
  file's slowest axis ``k``; each slice is read from the file once, in increasing ``k``, so a
  ``.nii.gz`` is decompressed in one forward pass);
- the model input (float32, 4 bytes per *model* voxel) and its normalised copy, as the loaded path;
- the uint8 labels on the input grid (1 byte per input voxel). They are not written slab by slab:
  the inversion finishes input slices in the order of the model grid's first axis (R-L), which is
  the file's fastest axis for the usual axial CT, so a NIfTI (Fortran order, slowest axis last)
  cannot be written as they come; one byte per voxel is what any label map occupies.

Why the labels are identical to the loaded path's
-------------------------------------------------
The loaded path's model input is :func:`medseg.inference.resample.resample_to_model`: with ``M`` the
scaled-permutation map from model voxels to input voxels, model voxel ``u`` is

    x(u) = lerp_2( lerp_1( lerp_0( f ) ) )(u),   lerp_a along model axis a, in float64,

where ``f`` is the input as MONAI's loader gives it: ``np.asanyarray(img.dataobj)`` (nibabel's scaling
applied elementwise) cast to float32. Every model voxel reads input slices ``k`` in
``[lo_k(u), hi_k(u)]`` only (two neighbours along the model axis ``b`` that reads input axis ``k``).
:func:`resample_streamed` cuts the model grid into chunks along ``b``, reads the input slices the
chunk needs, and evaluates the *same* three lerps in the *same* order with the same weights and the
index pairs shifted by the slab's first slice. Each output value is therefore the same sequence of
float64 operations on the same float32 operands: the model input is equal bit for bit, and from
there the code is shared (intensity normalisation on the whole model grid, sliding window, inversion).
So no label can differ, at slab borders or elsewhere; ``tests/inference/test_infer_stream.py`` checks it with
exact equality on anisotropic, flipped and permuted inputs.

The one condition: the loaded path and the streaming path must start from the same affine. Both take
nibabel's ``img.affine`` (MONAI's ``NibabelReader`` does), after :func:`medseg.datasets.checks.open_nifti`
has checked the header. An input whose voxel map mixes axes (a sheared affine) is loaded whole and
takes MONAI's transforms, as in the loaded path; 4D inputs are loaded whole too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.data import MetaTensor

from medseg.datasets import checks
from medseg.errors import DataError
from medseg.inference.resample import as_axis_map, axis_weights, lerp_axis
from medseg.training import transforms as tf

log = logging.getLogger(__name__)
NIFTI_SUFFIXES = checks.NIFTI_SUFFIXES

#: Inputs with more voxels than this are streamed by ``medseg infer`` (128 Mi voxels: 512 x 512 x 512,
#: 512 MiB as float32). ``MEDSEG_STREAM_VOXELS`` overrides it; ``medseg infer --stream-above`` too.
STREAM_VOXELS = 128 * 2**20
#: Bytes of input slices (float32) plus float64 work that one chunk of :func:`resample_streamed` may use.
STREAM_SLAB_BYTES = 128 * 2**20


def stream_threshold(value: int | None = None) -> int:
    """The voxel count above which inputs are streamed: ``value``, else ``MEDSEG_STREAM_VOXELS``, else the default."""
    if value is not None:
        if value < 0:
            raise DataError(f"--stream-above must be a voxel count >= 0, got {value}")
        return int(value)
    env = os.environ.get("MEDSEG_STREAM_VOXELS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise DataError(f"MEDSEG_STREAM_VOXELS={env!r} is not a whole number of voxels") from None
        if n < 0:
            raise DataError(f"MEDSEG_STREAM_VOXELS={env!r} must be >= 0")
        return n
    return STREAM_VOXELS


class LazyVolume:
    """A 3D NIfTI file opened for streaming: shape ``(1, I, J, K)``, affine, meta, slab reads along ``k``.

    It stands in for the loaded MetaTensor where :func:`medseg.inference.predict.predict` needs only geometry
    (``shape``, ``affine``, ``meta``). :meth:`slices` reads input slices ``k0:k1`` as MONAI's loader
    would give them (float32 of nibabel's scaled array) and checks that they are finite.
    """

    def __init__(self, path: str | Path, img: Any) -> None:
        self.path = Path(path)
        self.img = img
        self.spatial = tuple(int(n) for n in img.shape[:3])
        self.shape = (1, *self.spatial)
        self.ndim = 4
        self.affine = torch.as_tensor(np.array(img.affine, dtype=np.float64))
        self.meta: dict[str, Any] = {
            "filename_or_obj": str(self.path),
            "sform_code": int(img.header["sform_code"]),
            "qform_code": int(img.header["qform_code"]),
        }
        self.dtype = torch.float32
        self.stored_itemsize = int(img.get_data_dtype().itemsize)

    @classmethod
    def open(cls, path: str | Path) -> LazyVolume:
        import nibabel as nib

        # one file handle for the proxy's lifetime: forward reads of a .nii.gz continue the same
        # decompression instead of starting again from the file's beginning
        return cls(path, nib.load(str(path), keep_file_open=True))

    def numel(self) -> int:
        return int(np.prod(self.shape))

    def element_size(self) -> int:
        """0: the voxels are not resident (see :func:`medseg.inference.memory.estimate`)."""
        return 0

    def slices(self, k0: int, k1: int) -> torch.Tensor:
        """Input slices ``k0:k1`` as (1, I, J, k1 - k0) float32, as ``LoadImage`` makes them."""
        data = np.asanyarray(self.img.dataobj[:, :, k0:k1]).astype(np.float32, copy=False)
        if not np.isfinite(data).all():
            raise DataError(f"{self.path}: the image holds NaN or infinite values; fix or exclude it")
        return torch.from_numpy(np.ascontiguousarray(data))[None]

    def load(self) -> Any:
        """The whole volume as a loaded MetaTensor (the fallback for maps that mix axes)."""
        return load_image(self.path)


class SlabReader:
    """Serves :meth:`LazyVolume.slices` requests ``[k0, k1)`` whose bounds never decrease.

    Keeps the slices read so far from the lowest still requested upwards and reads only the new ones,
    so every slice comes from the file once and in order.
    """

    def __init__(self, volume: LazyVolume) -> None:
        self.volume = volume
        self.k0 = self.k1 = 0
        self.buf: torch.Tensor | None = None
        self.reads = 0  # slices read from the file, for the tests

    def __call__(self, k0: int, k1: int) -> torch.Tensor:
        if k0 < self.k0 or k1 < self.k1:  # pragma: no cover - resample_streamed asks in order
            raise RuntimeError(f"slab [{k0}, {k1}) requested after [{self.k0}, {self.k1})")
        keep = self.buf[..., k0 - self.k0 :] if self.buf is not None and k0 < self.k1 else None
        start = max(k0, self.k1)
        parts = [] if keep is None else [keep]
        if k1 > start:
            parts.append(self.volume.slices(start, k1))
            self.reads += k1 - start
        self.buf = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        self.k0, self.k1 = k0, k1
        return self.buf


def load_image(
    source: str | Path,
    series_uid: str | None = None,
    resample: bool = False,
    stream_above: int | None = None,
) -> MetaTensor | LazyVolume:
    """Read a NIfTI file, a DICOM series folder or one DICOM file (e.g. an Enhanced multi-frame image)
    as a (C, I, J, K) MetaTensor with its RAS affine.

    With ``stream_above`` set, a 3D NIfTI file of more voxels than that is not read: a
    :class:`LazyVolume` (header and array proxy) is returned, which ``predict``
    reads slab by slab (the streaming path; same labels, see the module docstring).
    """
    from medseg.datasets.dicom.header import is_dicom_file

    source = checks.check_input_path(
        source, "input", hint="give a NIfTI file (.nii, .nii.gz), a DICOM series folder or a DICOM file"
    )
    dicom_file = is_dicom_file(source)
    if source.is_file() and not source.name.endswith(NIFTI_SUFFIXES) and not dicom_file:
        raise DataError(
            f"{source}: not a NIfTI file (.nii, .nii.gz) and not a DICOM file; give one of those, or the "
            "folder that holds a DICOM series"
        )
    if source.is_file() and not dicom_file:
        # header checks (size against memory, qform/sform policy) before a single voxel is decompressed
        img, _ = checks.open_nifti(source, memory=stream_above is None)
        if stream_above is not None:
            if len(img.shape) == 3 and int(np.prod(img.shape)) > stream_above:
                log.info(
                    "%s: %d voxels, above %d: streaming the input", source, np.prod(img.shape), stream_above
                )
                return LazyVolume.open(source)
            checks.open_nifti(source)  # loading it whole after all: the memory check applies
    image = tf.apply(tf.loader(["image"], series_uid=series_uid, resample=resample), {"image": str(source)})[
        "image"
    ]
    if image.ndim != 4:
        raise DataError(f"{source}: expected a 3D volume, got an image of shape {tuple(image.shape[1:])}")
    if not torch.isfinite(image).all():
        raise DataError(f"{source}: the image holds NaN or infinite values; fix or exclude it")
    return image


@torch.no_grad()
def resample_streamed(
    volume: LazyVolume, m: np.ndarray, out_shape: tuple[int, int, int], budget: int | None = None
) -> torch.Tensor:
    """:func:`medseg.inference.resample.resample_to_model` of ``volume``, reading the input in ``k`` slabs.

    Same arguments and result (bit for bit: see the module docstring) as
    ``resample_to_model(volume.load(), m, out_shape)``; the input is never resident as a whole.
    """
    budget = STREAM_SLAB_BYTES if budget is None else budget
    amap = as_axis_map(m)
    if amap is None:
        raise ValueError("resample_streamed needs an axis-aligned map")
    perm = amap.perm
    in_sizes = volume.spatial
    # model axis a reads input axis perm[a]; q-axis sizes are the input sizes in model order
    axes = [
        axis_weights(n, in_sizes[perm[a]], amap.scale[a], amap.offset[a], torch.float64)
        for a, n in enumerate(out_shape)
    ]
    b = perm.index(2)  # the model axis that reads the file's slowest axis
    lo_b, hi_b, w_b = axes[b]
    n_b = out_shape[b]
    out = torch.empty((1, *out_shape), dtype=torch.float32)
    plane_in = in_sizes[0] * in_sizes[1]
    plane_out = int(np.prod(out_shape)) // max(1, n_b)
    # per model index along b: about 1 input slice (float32, + its float64 gathers) and the float64 work
    per = 4 * plane_in * max(1.0, abs(amap.scale[b])) + 8 * 3 * max(plane_in, plane_out)
    chunk = max(1, int(budget // max(1.0, per)))
    starts = list(range(0, n_b, chunk))
    if len(lo_b) > 1 and lo_b[0] > lo_b[-1]:  # model axis runs against k: visit chunks by increasing k
        starts.reverse()
    reader = SlabReader(volume)
    for s in starts:
        e = min(n_b, s + chunk)
        lo, hi = lo_b[s:e], hi_b[s:e]
        k0, k1 = int(lo.min()), int(hi.max()) + 1
        slab = reader(k0, k1)
        q = slab.permute(0, *(1 + p for p in perm))
        local = [axes[a] if a != b else (lo - k0, hi - k0, w_b[s:e]) for a in range(3)]
        block = lerp_axis(q, 1, *local[0], torch.float64)
        block = lerp_axis(block, 2, *local[1])
        block = lerp_axis(block, 3, *local[2])
        idx = [slice(None)] * 4
        idx[1 + b] = slice(s, e)
        out[tuple(idx)] = block
        del block, q, slab
    return out
