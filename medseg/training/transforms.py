"""MONAI transform chains for training, validation and inference.

Every chain starts the same way so that a model sees the same voxels at training and at inference:
load (NIfTI file or DICOM series folder) -> channel first -> orient RAS -> resample to
``transforms.spacing`` -> normalise intensities (:func:`intensity`, by ``transforms.normalize``: a
fixed window onto [0, 1], CT clipped to foreground percentiles and z-scored, or a z-score per image).
Inference chains are invertible, so that ``Invertd`` maps a prediction back onto the input's own grid
and affine. Classification then sees the volume about its centre, or the image's object resized to
fit the patch (``transforms.roi``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from monai import transforms as mt
from scipy.ndimage import gaussian_filter

from medseg.config import Config
from medseg.datasets.dicom.reader import DicomSeriesReader
from medseg.errors import DataError, MedsegError
from medseg.training import augment


class LoadVolumed(mt.LoadImaged):
    """``LoadImaged`` that reads NIfTI files with nibabel and DICOM series folders with medseg's reader.

    medseg's DICOM reader checks slice positions instead of averaging uneven spacing away, which
    MONAI's own ``PydicomReader`` does silently.
    """

    def __init__(self, keys: list[str], series_uid: str | None = None, resample: bool = False) -> None:
        super().__init__(keys, image_only=True)
        # Registered last, so LoadImage asks it first; it accepts folders only, files go to nibabel.
        self.register(DicomSeriesReader(series_uid=series_uid, resample=resample))


def loader(keys: list[str], series_uid: str | None = None, resample: bool = False) -> mt.Compose:
    """Read files or DICOM folders into channel-first MetaTensors in their own geometry."""
    return mt.Compose(
        [LoadVolumed(keys, series_uid=series_uid, resample=resample), mt.EnsureChannelFirstd(keys)]
    )


def _ct_range(cfg: Config) -> tuple[float, float, float, float]:
    """(a_min, a_max, b_min, b_max) of the CT scheme: clip to [lo, hi], then (x - mean) / std.

    Clipping then z-scoring is one clipped linear map, so MONAI's ``ScaleIntensityRange`` does it
    exactly: [lo, hi] -> [(lo - mean) / std, (hi - mean) / std].
    """
    n = cfg.transforms.normalize
    lo, hi = n.clip
    return lo, hi, (lo - n.mean) / n.std, (hi - n.mean) / n.std


def intensity_array(cfg: Config) -> mt.Transform:
    """The normalisation of ``transforms.normalize`` as an array transform (MONAI's), for bare tensors."""
    n, t = cfg.transforms.normalize, cfg.transforms
    if n.scheme == "ct":
        a_min, a_max, b_min, b_max = _ct_range(cfg)
        return mt.ScaleIntensityRange(a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, clip=True)
    if n.scheme == "zscore":
        return mt.NormalizeIntensity(nonzero=True, channel_wise=True)
    return mt.ScaleIntensityRange(a_min=t.window[0], a_max=t.window[1], b_min=0.0, b_max=1.0, clip=True)


def intensity(cfg: Config, key: str = "image") -> mt.MapTransform:
    """The normalisation of ``transforms.normalize`` on ``key`` of a dict (see :class:`NormalizeConfig`).

    window: ``(clip(x, a, b) - a) / (b - a)``; ct: ``(clip(x, lo, hi) - mean) / std`` with the dataset's
    foreground statistics; zscore: ``(x - m) / s`` where m, s are the mean and standard deviation of
    this image's non-zero voxels, zeros kept at 0 (MONAI's ``NormalizeIntensity(nonzero=True)``).
    """
    n, t = cfg.transforms.normalize, cfg.transforms
    if n.scheme == "ct":
        a_min, a_max, b_min, b_max = _ct_range(cfg)
        return mt.ScaleIntensityRanged(key, a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, clip=True)
    if n.scheme == "zscore":
        return mt.NormalizeIntensityd(key, nonzero=True, channel_wise=True)
    return mt.ScaleIntensityRanged(key, a_min=t.window[0], a_max=t.window[1], b_min=0.0, b_max=1.0, clip=True)


class Above:
    """Foreground selector: normalised values above ``threshold`` (the scheme's image of its low bound)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = float(threshold)

    def __call__(self, img: Any) -> Any:
        return img > self.threshold


class NonZero:
    """Foreground selector of the z-score scheme: the non-zero voxels its statistics came from."""

    def __call__(self, img: Any) -> Any:
        return img != 0


def body(cfg: Config) -> Above | NonZero:
    """Which normalised voxels are "the body" for ``transforms.crop_foreground``.

    window: above 0, i.e. above the window's low end (MONAI's default threshold); ct: above the
    clip's low end; zscore: non-zero voxels.
    """
    scheme = cfg.transforms.normalize.scheme
    if scheme == "ct":
        return Above(_ct_range(cfg)[2])
    if scheme == "zscore":
        return NonZero()
    return Above(0.0)


def otsu_threshold(values: np.ndarray, bins: int = 256) -> float:
    """Otsu's threshold: the cut t of a histogram maximising the between-class variance.

    With class weights w0(t) = P(x <= t), w1 = 1 - w0 and class means m0(t), m1(t), Otsu's t
    maximises w0 w1 (m0 - m1)^2, equivalently (m w0 - mu(t))^2 / (w0 (1 - w0)) where mu(t) is the
    cumulative first moment and m the global mean.
    """
    hist, edges = np.histogram(values, bins=bins)
    p = hist.astype(np.float64) / max(hist.sum(), 1)
    centres = (edges[:-1] + edges[1:]) / 2
    w0 = np.cumsum(p)
    mu = np.cumsum(p * centres)
    m = mu[-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        between = (m * w0 - mu) ** 2 / (w0 * (1.0 - w0))
    between[~np.isfinite(between)] = -1.0
    return float(edges[int(np.argmax(between)) + 1])


class ObjectMask:
    """Foreground selector for classification: the voxels of a Gaussian-smoothed copy (sigma 1 voxel)
    above its Otsu threshold.

    Smoothing first lowers the noise's standard deviation several-fold, so single noisy voxels do not
    cross the threshold and widen the bounding box to the whole volume.
    """

    def __call__(self, img: Any) -> Any:
        arr = img.detach().cpu().numpy() if isinstance(img, torch.Tensor) else np.asarray(img)
        smooth = np.stack([gaussian_filter(c.astype(np.float32), sigma=1.0) for c in arr])
        mask = smooth > otsu_threshold(smooth)
        return torch.as_tensor(mask) if isinstance(img, torch.Tensor) else mask


def _geometry(cfg: Config, keys: list[str], modes: list[str]) -> list:
    """Orient to RAS, resample to the model's spacing, normalise intensities (:func:`intensity`)."""
    t = cfg.transforms
    return [
        mt.Orientationd(keys, axcodes="RAS"),
        mt.Spacingd(keys, pixdim=t.spacing, mode=modes),
        intensity(cfg),
    ]


def _classification_view(cfg: Config) -> list:
    """centre: pad or crop about the centre to the patch. object: crop to the object's bounding box
    (:class:`ObjectMask`, 2 voxels of margin), resize so its longest side is the patch's shortest
    (aspect ratio kept, so the whole object fits), then pad to the patch."""
    patch = list(cfg.transforms.patch)
    if cfg.transforms.roi == "object":
        return [
            mt.CropForegroundd(
                "image", source_key="image", select_fn=ObjectMask(), margin=2, allow_smaller=True
            ),
            mt.Resized("image", spatial_size=min(patch), size_mode="longest", mode="trilinear"),
            mt.ResizeWithPadOrCropd("image", spatial_size=patch),
        ]
    return [mt.ResizeWithPadOrCropd("image", spatial_size=patch)]


def preprocess(cfg: Config) -> mt.Compose:
    """Invertible chain from a loaded image to model input; inference, evaluation and the viewer use it."""
    chain = _geometry(cfg, ["image"], ["bilinear"])
    if cfg.task == "classification":
        chain += _classification_view(cfg)
    return mt.Compose([*chain, mt.EnsureTyped("image", track_meta=True)])


def seg_train(cfg: Config) -> mt.Compose:
    """Load, normalise, crop to the body, then sample pos/neg patches and augment (:mod:`medseg.training.augment`)."""
    t, keys = cfg.transforms, ["image", "label"]
    chain = [*loader(keys).transforms, *_geometry(cfg, keys, ["bilinear", "nearest"])]
    if t.crop_foreground:
        chain.append(mt.CropForegroundd(keys, source_key="image", select_fn=body(cfg), allow_smaller=True))
    chain += [
        mt.SpatialPadd(keys, spatial_size=[n + 2 * t.shift for n in t.patch]),
        mt.EnsureTyped(keys, track_meta=True),
        # Everything above is deterministic and cached; everything below is drawn anew each epoch.
        mt.RandCropByPosNegLabeld(
            keys,
            label_key="label",
            spatial_size=t.patch,
            pos=t.pos,
            neg=t.neg,
            num_samples=t.num_samples,
            image_key="image",
            # background patches are centred inside the body only (window: above 0); a non-zero body (zscore)
            # has no threshold here, so any voxel may centre one
            image_threshold=body(cfg).threshold if isinstance(body(cfg), Above) else -1e30,
        ),
    ]
    if t.augment:
        chain += augment.recipe(t.augment_recipe, keys, flip_axes=t.flip_axes)
    return mt.Compose(chain)


def seg_val(cfg: Config) -> mt.Compose:
    """Whole resampled volumes with their labels, for validation during training."""
    keys = ["image", "label"]
    chain = [*loader(keys).transforms, *_geometry(cfg, keys, ["bilinear", "nearest"])]
    if cfg.transforms.crop_foreground:
        chain.append(mt.CropForegroundd(keys, source_key="image", select_fn=body(cfg), allow_smaller=True))
    return mt.Compose([*chain, mt.EnsureTyped(keys, track_meta=True)])


def cls_train(cfg: Config) -> mt.Compose:
    """Classification: load + preprocess, then flips, right-angle turns and intensity scaling."""
    chain = [*loader(["image"]).transforms, *preprocess(cfg).transforms]
    if cfg.transforms.augment:
        chain += [
            mt.RandFlipd("image", prob=0.5, spatial_axis=0),
            mt.RandFlipd("image", prob=0.5, spatial_axis=1),
            mt.RandFlipd("image", prob=0.5, spatial_axis=2),
            mt.RandRotate90d("image", prob=0.5, max_k=3),
            mt.RandScaleIntensityd("image", factors=0.1, prob=0.5),
        ]
    return mt.Compose(chain)


def cls_val(cfg: Config) -> mt.Compose:
    return mt.Compose([*loader(["image"]).transforms, *preprocess(cfg).transforms])


def apply(chain: mt.Compose, item: dict[str, Any]) -> Any:
    """Run ``chain`` on one item; a failure becomes a DataError naming the item's files.

    MONAI wraps an exception raised inside a transform in ``RuntimeError("applying transform ...")``;
    a medseg error found in that chain of causes is raised as it is.
    """
    try:
        return chain(item)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, MedsegError):
                raise cause from None
            root, cause = cause, cause.__cause__
        files = ", ".join(str(v) for k, v in item.items() if k in ("image", "label"))
        raise DataError(
            f"{files}: could not be loaded or transformed ({type(root).__name__}: {str(root).splitlines()[0] if str(root) else ''}); check it with `medseg data validate`"
        ) from exc
