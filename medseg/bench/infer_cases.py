"""The inputs of ``medseg bench infer``: synthetic CT volumes and demo-sized bundles.

The CT is HU-valued and LPS-stored at 0.78 x 0.78 x 1 mm: air, a body ellipse of soft tissue,
brighter spherical blobs and Gaussian noise, made slab by slab from a seeded generator so that the
same (shape, seed) always gives the same voxels, in memory (:func:`synthetic_ct`) or as an int16
NIfTI file (:func:`write_synthetic_nifti`). The models are demo-sized UNets with seeded random
weights (:func:`make_bundle`): the benchmark compares labels, not accuracy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

SPACING = (0.78, 0.78, 1.0)


def synthetic_affine(
    shape: tuple[int, int, int], spacing: tuple[float, float, float] = SPACING
) -> np.ndarray:
    """LPS-stored, centred; rounded through float32 as a NIfTI header stores it, so that the loaded
    synthetic CT and its file (:func:`write_synthetic_nifti`) have the very same affine."""
    ni, nj, nk = shape
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
    affine[:3, 3] = [spacing[0] * ni / 2, spacing[1] * nj / 2, -spacing[2] * nk / 2]
    return affine.astype(np.float32).astype(np.float64)


def synthetic_ct(shape: tuple[int, int, int], spacing: tuple[float, float, float] = SPACING, seed: int = 0):
    """A CT-like float32 MetaTensor (1, I, J, K): air, a body ellipse of soft tissue, brighter blobs, noise.

    Made slice block by slice block from int16, so that making it never needs more than the input.
    """
    from monai.data import MetaTensor

    ni, nj, nk = shape
    out = torch.empty((1, ni, nj, nk), dtype=torch.float32)
    for k0, k1, block in synthetic_blocks(shape, spacing, seed):
        out[0, :, :, k0:k1] = torch.from_numpy(block)
    return MetaTensor(
        out,
        affine=torch.as_tensor(synthetic_affine(shape, spacing)),
        meta={"filename_or_obj": f"synthetic-{ni}x{nj}x{nk}"},
    )


def write_synthetic_nifti(
    path: Path, shape: tuple[int, int, int], spacing: tuple[float, float, float] = SPACING, seed: int = 0
) -> Path:
    """:func:`synthetic_ct` as an int16 NIfTI file, written slice block by slice block (gzip level 1 for
    ``.nii.gz``): the voxels equal the loaded synthetic CT's, and writing never holds the whole volume."""
    import gzip

    import nibabel as nib

    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.int16)
    affine = synthetic_affine(shape, spacing)
    hdr.set_sform(affine, code=1)
    hdr.set_qform(affine, code=1)
    hdr.set_xyzt_units("mm")
    hdr.set_data_offset(352)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    opener = gzip.open(tmp, "wb", compresslevel=1) if path.name.endswith(".gz") else open(tmp, "wb")
    with opener as f:
        hdr.write_to(f)  # 348 bytes and the 4-byte extension flag: the voxels start at 352
        for _, _, block in synthetic_blocks(shape, spacing, seed):
            f.write(block.astype("<i2").tobytes(order="F"))
    os.replace(tmp, path)
    return path


def synthetic_blocks(
    shape: tuple[int, int, int], spacing: tuple[float, float, float], seed: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(k0, k1, block)``: the synthetic CT's slices ``k0:k1`` as (I, J, k1 - k0) float32 integers."""
    rs = np.random.RandomState(seed)
    ni, nj, nk = shape
    x = (np.arange(ni)[:, None] - (ni - 1) / 2) / (0.45 * ni)
    y = (np.arange(nj)[None, :] - (nj - 1) / 2) / (0.38 * nj)
    body = (x**2 + y**2) <= 1.0
    centres = rs.uniform(0.25, 0.75, size=(12, 3)) * np.array(shape)
    radii = rs.uniform(0.04, 0.12, size=12) * min(ni, nj)
    hu = rs.choice([60.0, 110.0, 220.0], size=12)
    step = max(1, (64 * 2**20) // (4 * ni * nj))
    for k0 in range(0, nk, step):
        k1 = min(nk, k0 + step)
        kk = np.arange(k0, k1)[None, None, :]
        block = np.where(body[:, :, None], 20.0, -1000.0).astype(np.float32) * np.ones(
            (1, 1, k1 - k0), np.float32
        )
        for c, r, v in zip(centres, radii, hu):
            rk = r * spacing[0] / spacing[2]  # radius in slices
            if k1 <= c[2] - rk or k0 >= c[2] + rk:
                continue
            i0, i1 = max(0, int(c[0] - r)), min(ni, int(c[0] + r) + 1)
            j0, j1 = max(0, int(c[1] - r)), min(nj, int(c[1] + r) + 1)
            d2 = (
                ((np.arange(i0, i1)[:, None, None] - c[0]) / r) ** 2
                + ((np.arange(j0, j1)[None, :, None] - c[1]) / r) ** 2
                + ((kk - c[2]) / rk) ** 2
            )
            sub = block[i0:i1, j0:j1]
            sub[d2 <= 1.0] = v
        block += rs.normal(0.0, 20.0, size=block.shape).astype(np.float32)
        yield k0, k1, block.round()


def make_bundle(workdir: Path, classes: int, seed: int = 0, patch: list[int] | None = None) -> Path:
    """A demo-sized UNet with ``classes`` outputs, seeded random weights, exported as a bundle."""
    from medseg.bundle.export import export_bundle
    from medseg.config import config_from_dict
    from medseg.models import build_network, network_def

    cfg = config_from_dict(
        {
            "name": f"bench-infer-{classes}cls",
            "task": "segmentation",
            "runs_dir": str(workdir),
            "data": {"dir": str(workdir / "no-data")},
            "transforms": {"spacing": [1.6, 1.6, 2.4], "window": [-150, 250], "patch": patch or [32, 32, 16]},
            "model": {"name": "unet", "channels": [16, 32, 64], "strides": [2, 2], "num_res_units": 1},
            "train": {"seed": seed},
            "infer": {"sw_batch_size": 8},
        }
    )
    torch.manual_seed(seed)
    net = build_network(network_def(cfg, out_channels=classes))
    labels = {str(k): ("background" if k == 0 else f"class{k}") for k in range(classes)}
    quiet = logging.getLogger("medseg.bundle.export")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        return export_bundle(cfg, {"model": net.state_dict(), "labels": labels, "epoch": 0}, {})
    finally:
        quiet.setLevel(level)
