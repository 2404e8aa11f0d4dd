"""MONAI transform chains for training, validation and inference.

Every chain starts the same way so that a model sees the same voxels at training and at inference:
load (NIfTI file or DICOM series folder) -> channel first -> orient RAS -> resample to
``transforms.spacing`` -> window intensities to [0, 1]. Inference chains are invertible, so that
``Invertd`` maps a prediction back onto the input's own grid and affine.
"""

from __future__ import annotations

from typing import Any

from monai import transforms as mt

from medseg.config import Config
from medseg.datasets.dicom import DicomSeriesReader
from medseg.errors import DataError, MedsegError


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


def _geometry(cfg: Config, keys: list[str], modes: list[str]) -> list:
    """Orient to RAS, resample to the model's spacing, window intensities to [0, 1]."""
    t = cfg.transforms
    return [
        mt.Orientationd(keys, axcodes="RAS"),
        mt.Spacingd(keys, pixdim=t.spacing, mode=modes),
        mt.ScaleIntensityRanged(
            "image", a_min=t.window[0], a_max=t.window[1], b_min=0.0, b_max=1.0, clip=True
        ),
    ]


def preprocess(cfg: Config) -> mt.Compose:
    """Invertible chain from a loaded image to model input; inference, evaluation and the viewer use it."""
    chain = _geometry(cfg, ["image"], ["bilinear"])
    if cfg.task == "classification":
        chain.append(mt.ResizeWithPadOrCropd("image", spatial_size=cfg.transforms.patch))
    return mt.Compose([*chain, mt.EnsureTyped("image", track_meta=True)])


def seg_train(cfg: Config) -> mt.Compose:
    """Load, normalise, crop to the body, then sample pos/neg patches and augment."""
    t, keys = cfg.transforms, ["image", "label"]
    chain = [*loader(keys).transforms, *_geometry(cfg, keys, ["bilinear", "nearest"])]
    if t.crop_foreground:
        chain.append(mt.CropForegroundd(keys, source_key="image", allow_smaller=True))
    chain += [
        mt.SpatialPadd(keys, spatial_size=t.patch),
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
            image_threshold=0.0,
        ),
    ]
    if t.augment:
        chain += [
            mt.RandFlipd(keys, prob=0.2, spatial_axis=0),
            mt.RandFlipd(keys, prob=0.2, spatial_axis=1),
            mt.RandFlipd(keys, prob=0.2, spatial_axis=2),
            mt.RandScaleIntensityd("image", factors=0.1, prob=0.5),
            mt.RandShiftIntensityd("image", offsets=0.05, prob=0.5),
        ]
    return mt.Compose(chain)


def seg_val(cfg: Config) -> mt.Compose:
    """Whole resampled volumes with their labels, for validation during training."""
    keys = ["image", "label"]
    chain = [*loader(keys).transforms, *_geometry(cfg, keys, ["bilinear", "nearest"])]
    if cfg.transforms.crop_foreground:
        chain.append(mt.CropForegroundd(keys, source_key="image", allow_smaller=True))
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
