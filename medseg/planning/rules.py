"""The planning rules: each choice ``medseg plan`` makes from a dataset's fingerprint, with its reason.

1. **Target spacing** (nnU-Net's rule): the median spacing along R, A, S. When the coarsest axis is
   more than 3x coarser than the finest other axis *and* has fewer than a third of their voxels
   (thick slices), it takes the 10th percentile of its spacings instead (but not finer than the
   other axes), so thick-slice cases are not interpolated into many invented slices. When the
   largest patch that fits sees less than a quarter of a median image (nnU-Net's low-resolution
   rule), the spacing is coarsened by 5% steps (finest axes first, up to the coarsest).
2. **Normalisation** of channel 0 by modality (``dataset.json``): CT is clipped to the foreground
   0.5-99.5 percentiles and z-scored with the foreground mean and standard deviation; anything else
   (MR, ...) is z-scored per image over its non-zero voxels (:func:`medseg.training.transforms.intensity`).
3. **Network**: DynUNet (kernels and strides from patch and spacing by nnU-Net's rule,
   :func:`medseg.models.dynunet_plan`; filters 32 doubling to 320), UNet (channels from a base width
   doubling per level, capped at 320; as many stride-2 levels as keep every axis >= 4 voxels) or
   SegResNet (MONAI's 4 stages). Default: DynUNet on CUDA, a small UNet on CPU. The patch is a
   multiple of the network's divisor on every axis. On CPU under ``--time-s`` the plan trades the
   small UNet for a *thin DynUNet* (nnU-Net's topology: two convolutions per level, the first level
   at full resolution; filters 16 doubling, capped at 320; two deep-supervision heads) when the
   budget trains that network for at least ``THIN_DYNUNET_STEPS`` steps at the fitted patch and
   batch (its topology probed for the step time and memory like any other). MONAI's UNet halves the
   patch in its first convolution; on Task04_Hippocampus the thin DynUNet reached in 26 CPU minutes
   the held-out Dice that the UNet with a full-resolution level reached in 58, and more than the
   plain UNet at any budget (docs/benchmarks.md, "The thin DynUNet"). Below that many steps its
   dearer steps (about twice the plain UNet's) buy less than the plain network's.
4. **Batch and epochs**: the batch is 2 patches, raised while the memory and the time allow and
   while one batch holds at most 5% of the dataset's voxels. It is held as ``train.batch_size``
   cases times ``transforms.num_samples`` patches drawn from each; the epochs are the planned
   training steps divided by the steps per epoch.
5. **Classification**: the image's object (:class:`medseg.training.transforms.ObjectMask`) is cropped and
   resized whole into a cubic patch whose side holds the largest object bounding box of the dataset
   at the target spacing (``transforms.roi: object``), instead of the volume's centre.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from medseg.errors import ConfigError, MedsegError

GB = 2**30
# The predicted total must stay within this share of the memory budget: the margin covers the model's
# error (measured by --verify, docs/benchmarks.md "Planning") and run-to-run allocator variation, so
# that the measured peak stays under the budget while the prediction is at most 10% low.
SAFETY = 0.9
TRAIN_SHARE = 0.8  # share of the time budget for training steps (the rest: loading, validation)
MIN_COVER = 0.25  # nnU-Net: the patch should see at least a quarter of a median image
DEFAULT_STEPS = {"cpu": 1000, "cuda": 25000}  # training steps of the planned batch (patches per step)
NUM_SAMPLES = 4  # at most this many patches drawn per cached volume per step (as the demo)
MAX_BATCH_SHARE = 0.05  # one batch holds at most this share of the dataset's voxels
# a CPU time budget plans the thin DynUNet (rules, 3.) when it trains it for this many steps
THIN_DYNUNET_STEPS = 450
# The demo's segmentation training (configs/demo-seg.yaml; tests/planning/test_plan.py checks they agree): on
# --device cpu without --time-s, a plan may cost at most what the demo's DEMO_STEPS steps of
# DEMO_BATCH cases x DEMO_SAMPLES patches cost (80 epochs of ceil(13 / 4) steps on its 13 training
# cases), both measured in the same run (process CPU seconds, so the load of a shared machine cancels).
DEMO_MODEL = {"name": "unet", "channels": [16, 32, 64], "strides": [2, 2], "num_res_units": 1}
DEMO_PATCH, DEMO_BATCH, DEMO_SAMPLES, DEMO_STEPS = [32, 32, 16], 4, 4, 320


def mm_text(v: list[float]) -> str:
    """Spacings or extents in millimetres, for the plan's reasons."""
    return " x ".join(f"{x:.3g}" for x in v) + " mm"


# ---------------------------------------------------------------------------------------------------
# spacing and normalisation


def target_spacing(fp: dict[str, Any]) -> tuple[list[float], str]:
    """nnU-Net's rule (module docstring, 1.) and the reason, in words."""
    target = list(fp["median_spacing"])
    size = list(fp["median_shape"])
    worst = int(np.argmax(target))
    others = [a for a in range(3) if a != worst]
    aniso_spacing = target[worst] > 3 * max(target[a] for a in others)
    aniso_voxels = size[worst] * 3 < min(size[a] for a in others)
    if aniso_spacing and aniso_voxels:
        p10 = fp["spacing_p10"][worst]
        chosen = max(p10, max(target[a] for a in others) + 1e-5)
        reason = (
            f"median {mm_text(target)}; axis {'RAS'[worst]} is anisotropic (> 3x the others' spacing, < 1/3 of "
            f"their voxels): its 10th percentile {p10:.3g} mm"
        )
        target[worst] = chosen
        return target, reason
    return (
        target,
        f"median spacing of {fp['num_cases']} cases, {mm_text(target)} (not anisotropic by nnU-Net's rule)",
    )


def median_at(fp: dict[str, Any], spacing: list[float]) -> list[float]:
    """Median image size (R, A, S) resampled to ``spacing`` (per case, then the median)."""
    sizes = [[n * s / t for n, s, t in zip(c["shape"], c["spacing"], spacing)] for c in fp["cases"]]
    return [float(v) for v in np.median(np.asarray(sizes), 0)]


def coarser(spacing: list[float]) -> list[float]:
    """5% coarser: the axes finer than the coarsest first, then all (nnU-Net's low-resolution step)."""
    top = max(spacing)
    if any(s < top * 0.999 for s in spacing):
        return [min(s * 1.05, top) if s < top * 0.999 else s for s in spacing]
    return [s * 1.05 for s in spacing]


def normalisation(fp: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The ``transforms.normalize`` mapping for the dataset's modality (module docstring, 2.) and why."""
    modality = str(fp["modality"]).upper()
    it = fp.get("foreground_intensity")
    if modality == "CT":
        if not it:
            raise MedsegError(
                f"{fp['dataset']}: a CT dataset without foreground voxels; its labels are all background"
            )
        norm = {
            "scheme": "ct",
            "clip": [round(it["p0_5"], 3), round(it["p99_5"], 3)],
            "mean": round(it["mean"], 3),
            "std": round(max(it["std"], 1e-3), 3),
        }
        why = (
            f"modality CT (dataset.json): clip to the foreground 0.5/99.5 percentiles, z-score with the "
            f"foreground mean and std ({it['samples']} foreground voxels sampled)"
        )
        return norm, why
    return {"scheme": "zscore"}, f"modality {modality} (dataset.json) has no physical unit: z-score per image"


# ---------------------------------------------------------------------------------------------------
# networks


def _levels(patch: list[int], max_levels: int) -> int:
    """Stride-2 levels that keep every axis at >= 4 voxels and divide the patch."""
    n = 0
    while n < max_levels and all(p % 2 ** (n + 1) == 0 and p // 2 ** (n + 1) >= 4 for p in patch):
        n += 1
    return n


def model_section(
    net: str, device: str, patch: list[int], spacing: list[float]
) -> tuple[dict[str, Any], str]:
    """The ``model`` mapping for ``net`` at ``patch`` and why; ``dynunet-thin`` is the planner's
    name for the thin DynUNet with deep supervision (rule 3)."""
    small = device == "cpu"
    if net == "unet":
        base, cap = (16, 3) if small else (32, 4)
        n = max(_levels(patch, cap), 1)
        return (
            {
                "name": "unet",
                "channels": [min(base * 2**i, 320) for i in range(n + 1)],
                "strides": [2] * n,
                "num_res_units": 1 if small else 2,
            },
            f"UNet: {n} stride-2 levels keep every patch axis >= 4 voxels; width {base} doubling per level"
            + (" (small: CPU)" if small else "")
            + ", capped at 320",
        )
    if net == "dynunet-thin":
        return thin_dynunet_section(patch, spacing)
    if net == "segresnet":
        base = 8 if small else 16
        return (
            {"name": "segresnet", "init_filters": base, "norm": "group"},
            f"SegResNet (MONAI's 4 stages, 3 downsamplings), {base} initial filters"
            + (" (small: CPU)" if small else ""),
        )
    if net == "dynunet":
        from medseg.models import dynunet_plan

        kernels, strides = dynunet_plan(patch, spacing)
        return (
            {"name": "dynunet"},
            f"DynUNet by nnU-Net's rule from patch and spacing: kernels {kernels}, strides {strides}, "
            "filters 32 doubling to 320",
        )
    raise ConfigError(f"--net: {net!r} is not a network the planner knows (unet, segresnet, dynunet)")


def thin_dynunet_section(patch: list[int], spacing: list[float]) -> tuple[dict[str, Any], str]:
    """DynUNet by nnU-Net's kernel and stride rule at ``patch``, thinned to 16 filters doubling per
    level (capped at 320), with up to two deep-supervision heads (one fewer than its decoder levels)."""
    from medseg.models import dynunet_plan

    kernels, strides = dynunet_plan(patch, spacing)
    levels = len(strides)
    filters = [min(16 * 2**i, 320) for i in range(levels)]
    heads = max(0, min(2, levels - 2))
    return (
        {"name": "dynunet", "filters": filters, "deep_supervision": heads},
        f"thin DynUNet (nnU-Net's rule: kernels {kernels}, strides {strides}), filters {filters}, "
        f"{heads} deep-supervision heads",
    )


def divisor(net: str, device: str) -> int:
    """Every patch axis is a multiple of this for ``net`` (its total downsampling)."""
    return {"unet": 8 if device == "cpu" else 16, "segresnet": 8, "dynunet": 16}[net]


def valid_patch(net: str, patch: list[int], spacing: list[float]) -> bool:
    """Whether ``net`` can be built at ``patch`` (DynUNet's rule needs enough voxels per level)."""
    if net == "dynunet":
        from medseg.models import dynunet_plan

        try:
            dynunet_plan(patch, spacing)
        except ConfigError:
            return False
    return True


# ---------------------------------------------------------------------------------------------------
# budget, batch and epochs


def default_memory_gb(device: str) -> float:
    """90% of the GPU's memory on CUDA (8 GiB without one); on CPU half the available memory, at most 8 GiB."""
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GB * 0.9
        return 8.0
    from medseg.sysinfo import available_memory

    return min(available_memory() / GB * 0.5, 8.0)


def split_batch(batch: int) -> tuple[int, int]:
    """(cases, patches per case) of a batch of ``batch`` patches.

    A training step holds batch_size cases x num_samples patches drawn from each
    (medseg.training.data), so the batch is split into the most patches per case (<= NUM_SAMPLES)
    that divides it: 2 -> 1 case x 2 patches, 8 -> 2 cases x 4."""
    samples = max(d for d in range(1, NUM_SAMPLES + 1) if batch % d == 0)
    return batch // samples, samples


def epochs_for(steps: int, n_train: int, cases: int) -> tuple[int, int]:
    """(epochs, steps per epoch) for ``steps`` training steps of ``cases`` cases each."""
    spe = max(1, math.ceil(n_train / cases))
    return max(1, math.ceil(steps / spe)), spe


# ---------------------------------------------------------------------------------------------------
# classification


def object_patch_side(ext: list[dict[str, float]], spacing: list[float]) -> tuple[int, float]:
    """(patch side, largest object extent in voxels): the cube holding the largest object bounding
    box at ``spacing``, between 16 and 128 voxels, rounded up to a multiple of 8."""
    side_vox = max(e["max"] / s for e, s in zip(ext, spacing))
    return int(math.ceil(min(max(side_vox, 16), 128) / 8) * 8), side_vox


def classification_model(device: str) -> tuple[dict[str, Any], str]:
    """A 3D ResNet: depth 10 at half width on CPU, depth 18 on CUDA; and why."""
    if device == "cpu":
        model = {"name": "resnet", "depth": 10, "width": 0.5, "norm": "batch"}
    else:
        model = {"name": "resnet", "depth": 18, "norm": "batch"}
    return model, "3D ResNet" + (" (depth 10, half width: CPU)" if device == "cpu" else " 18")
