"""Random transforms that augment a training patch (``transforms.augment_recipe``), in MONAI's terms.

Both recipes act on a patch already cropped by ``RandCropByPosNegLabeld`` (image and label alike for
spatial transforms, the image only for intensity transforms):

- ``light``: each axis flipped with p = 0.2; intensity x (1 + u), u ~ U(-0.1, 0.1), p = 0.5; plus
  an offset ~ U(-0.05, 0.05), p = 0.5. Cheap; what every run did before the recipes.
- ``nnunet``: nnU-Net v2's default training augmentation (Isensee et al., Nature Methods 2021,
  supplementary "data augmentation"), each step with nnU-Net's probability and range:
  rotation about every axis by U(-30 deg, 30 deg), p = 0.2; isotropic scaling by U(0.7, 1.4),
  p = 0.2 (label resampled nearest); Gaussian noise of variance U(0, 0.1), p = 0.1; Gaussian blur
  with sigma U(0.5, 1), p = 0.2; brightness x U(0.75, 1.25), p = 0.15; contrast about the mean
  x U(0.75, 1.25) clipped to the patch's range, p = 0.15; low-resolution simulation (nearest
  down-sampling by U(0.5, 1), trilinear back), p = 0.25; inverted gamma (1 - (1 - x)^g), p = 0.1,
  and gamma x^g, p = 0.3, with g ~ U(0.7, 1.5) on intensities mapped to [0, 1] and the patch's mean
  and standard deviation restored; mirroring of each axis with p = 0.5. Elastic deformation is off,
  as in nnU-Net v2's default.
"""

from __future__ import annotations

import math

from monai import transforms as mt

ROTATION = math.radians(30.0)


def light(
    keys: list[str], image: str = "image", flip_axes: tuple[int, ...] = (0, 1, 2)
) -> list[mt.Transform]:
    return [
        *(mt.RandFlipd(keys, prob=0.2, spatial_axis=axis) for axis in flip_axes),
        mt.RandScaleIntensityd(image, factors=0.1, prob=0.5),
        mt.RandShiftIntensityd(image, offsets=0.05, prob=0.5),
    ]


def _spatial(keys: list[str]) -> list[mt.Transform]:
    modes = ["bilinear" if k == "image" else "nearest" for k in keys]
    return [
        mt.RandAffined(keys, prob=0.2, rotate_range=[ROTATION] * 3, mode=modes, padding_mode="zeros"),
        mt.RandAffined(keys, prob=0.2, scale_range=[(-0.3, 0.4)] * 3, mode=modes, padding_mode="zeros"),
    ]


def _intensity(image: str) -> list[mt.Transform]:
    return [
        mt.RandGaussianNoised(image, prob=0.1, std=math.sqrt(0.1)),
        mt.RandGaussianSmoothd(image, prob=0.2, sigma_x=(0.5, 1.0), sigma_y=(0.5, 1.0), sigma_z=(0.5, 1.0)),
        mt.RandScaleIntensityd(image, factors=0.25, prob=0.15),
        mt.RandScaleIntensityFixedMeand(image, factors=0.25, preserve_range=True, prob=0.15),
        mt.RandSimulateLowResolutiond(image, prob=0.25, zoom_range=(0.5, 1.0)),
        mt.RandAdjustContrastd(image, prob=0.1, gamma=(0.7, 1.5), invert_image=True, retain_stats=True),
        mt.RandAdjustContrastd(image, prob=0.3, gamma=(0.7, 1.5), retain_stats=True),
    ]


def nnunet(
    keys: list[str], image: str = "image", flip_axes: tuple[int, ...] = (0, 1, 2)
) -> list[mt.Transform]:
    return [
        *_spatial(keys),
        *_intensity(image),
        *(mt.RandFlipd(keys, prob=0.5, spatial_axis=axis) for axis in flip_axes),
    ]


def recipe(
    name: str, keys: list[str], image: str = "image", flip_axes: tuple[int, ...] = (0, 1, 2)
) -> list[mt.Transform]:
    """The random transforms of ``transforms.augment_recipe`` (see the module docstring), mirroring
    only the axes in ``flip_axes`` (``transforms.flip_axes``)."""
    build = nnunet if name == "nnunet" else light
    return build(keys, image, tuple(flip_axes))
