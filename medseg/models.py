"""Network choice by config, expressed as a MONAI bundle ``network_def``.

The same ``{"_target_": ..., **args}`` mapping builds the model for training and is written into the
bundle's inference config, so a bundle rebuilds exactly the network it was trained with.
"""

from __future__ import annotations

from typing import Any

import torch
from monai.bundle import ConfigParser

from medseg.config import Config
from medseg.errors import ConfigError

_NORM = {"instance": "INSTANCE", "batch": "BATCH", "group": ("GROUP", {"num_groups": 8})}


def dynunet_plan(
    patch: list[int], spacing: list[float], max_levels: int = 5
) -> tuple[list[list[int]], list[list[int]]]:
    """Kernel sizes and strides per level for DynUNet, by the nnU-Net rule.

    At each level an axis is downsampled (stride 2) while its spacing is within 2x of the finest
    axis and its size stays >= 8; an axis more than 2x coarser gets kernel 1 in-plane-only
    convolutions until the others catch up. The patch must divide by the product of strides.
    """
    sizes, spacings = [float(p) for p in patch], list(spacing)
    kernels, strides = [], [[1, 1, 1]]
    for _ in range(max_levels):
        ratio = [s / min(spacings) for s in spacings]
        stride = [2 if r <= 2 and size >= 8 else 1 for r, size in zip(ratio, sizes)]
        if all(s == 1 for s in stride):
            break
        if any(size % s for size, s in zip(sizes, stride)):
            raise ConfigError(
                f"transforms.patch: {patch} cannot be halved evenly for dynunet; use multiples of 16"
            )
        kernels.append([3 if r <= 2 else 1 for r in ratio])
        strides.append(stride)
        sizes = [size / s for size, s in zip(sizes, stride)]
        spacings = [sp * s for sp, s in zip(spacings, stride)]
    kernels.append([3, 3, 3])
    return kernels, strides


def network_def(cfg: Config, out_channels: int, in_channels: int = 1) -> dict[str, Any]:
    """The MONAI bundle ``network_def`` for ``cfg.model``."""
    m = cfg.model
    norm = _NORM[m.norm]
    if m.name == "unet":
        return {
            "_target_": "monai.networks.nets.UNet",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "channels": list(m.channels),
            "strides": list(m.strides),
            "num_res_units": m.num_res_units,
            "norm": norm,
            "dropout": m.dropout,
        }
    if m.name == "segresnet":
        return {
            "_target_": "monai.networks.nets.SegResNet",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "init_filters": m.init_filters,
            "norm": norm,
            "dropout_prob": m.dropout or None,
        }
    if m.name == "dynunet":
        kernels, strides = dynunet_plan(cfg.transforms.patch, cfg.transforms.spacing)
        return {
            "_target_": "monai.networks.nets.DynUNet",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "kernel_size": kernels,
            "strides": strides,
            "upsample_kernel_size": strides[1:],
            "norm_name": norm,
            "dropout": m.dropout or None,
        }
    if m.name == "swinunetr":
        return {
            "_target_": "monai.networks.nets.SwinUNETR",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "feature_size": m.feature_size,
            "norm_name": m.norm if m.norm != "group" else "instance",
            "drop_rate": m.dropout,
        }
    if m.name == "densenet121":
        return {
            "_target_": "monai.networks.nets.DenseNet121",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "init_features": m.init_filters,
            "dropout_prob": m.dropout,
        }
    if m.name == "resnet":
        return {
            "_target_": f"monai.networks.nets.resnet{m.depth}",
            "spatial_dims": 3,
            "n_input_channels": in_channels,
            "num_classes": out_channels,
            "widen_factor": m.width,
            "conv1_t_size": 3,  # a 7^3 stem costs more than the rest of a small 3D ResNet
            "norm": norm,
        }
    raise ConfigError(f"model.name: unknown network {m.name!r}")  # pragma: no cover - schema forbids it


def build_network(definition: dict[str, Any]) -> torch.nn.Module:
    """Instantiate a ``network_def`` mapping with MONAI's bundle config parser."""
    parser = ConfigParser({"network_def": definition})
    try:
        return parser.get_parsed_content("network_def", instantiate=True)
    except RuntimeError as exc:  # MONAI wraps the network's own complaint
        cause = exc.__cause__ or exc
        shown = {k: v for k, v in definition.items() if k != "_target_"}
        raise ConfigError(
            f"model: {definition['_target_']} cannot be built with {shown} ({type(cause).__name__}: {cause}); "
            "check model.name, model.norm and the sizes"
        ) from None
