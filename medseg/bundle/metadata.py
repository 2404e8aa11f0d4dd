"""What a bundle says about itself: ``configs/metadata.json`` (MONAI's bundle metadata schema, plus
medseg's labels and metrics) and the facts it shares with the README: the output file names, the
modality and the intensity normalisation in words."""

from __future__ import annotations

from typing import Any

import monai
import numpy as np
import torch

from medseg import __version__
from medseg.config import Config

SCHEMA = (
    "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/meta_schema_20240725.json"
)
SEG_POSTFIX = "seg"  # inference.json writes <input name>_seg.nii.gz
CLS_FILENAME = "predictions.csv"  # inference.json writes the class probabilities of every input here


def modality_of(validation: dict[str, Any]) -> str:
    """Channel 0's modality from the validation data's ``dataset.json`` (CT when it names none)."""
    modality = validation.get("modality") or {}
    return str(modality.get("0", next(iter(modality.values()), "CT")))


def dataset_label(validation: dict[str, Any]) -> str:
    """The training dataset as a bundle names it: ``dataset.json``'s name, else its folder as recorded
    in ``validation`` (a base name unless ``data.share_paths``)."""
    return str(validation.get("dataset_name") or validation.get("dataset_dir") or "its dataset")


def intensity_text(cfg: Config) -> str:
    """One line saying how intensities are normalised, for people (bundle README, metadata, viewer)."""
    n, t = cfg.transforms.normalize, cfg.transforms
    if n.scheme == "zscore":
        return "z-scored per image over its non-zero voxels (mean 0, standard deviation 1; zeros kept)"
    if n.scheme == "ct":
        return (
            f"clipped to [{n.clip[0]:g}, {n.clip[1]:g}] (the training set's foreground 0.5-99.5 percentiles), "
            f"then (x - {n.mean:g}) / {n.std:g} (its foreground mean and standard deviation)"
        )
    return f"window {t.window[0]:g} to {t.window[1]:g} mapped linearly onto [0, 1] and clipped"


def metadata(
    cfg: Config,
    labels: dict[int, str],
    metrics: dict[str, Any],
    epoch: int,
    validation: dict[str, Any],
    torchscript_problem: str | None,
) -> dict[str, Any]:
    """The contents of ``configs/metadata.json``."""
    t = cfg.transforms
    channel_def = {str(k): v for k, v in labels.items()}
    packages = _packages(cfg)
    return {
        "schema": SCHEMA,
        "version": "0.1.0",
        "changelog": {"0.1.0": f"trained by medseg {__version__}, run {cfg.name}, best epoch {epoch}"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": np.__version__,
        # The bundle specification names this key `optional_packages_version`; MONAI 1.6 renames that
        # to `required_packages_version` on reading (the newer schema's key), so both hold the same list.
        "required_packages_version": packages,
        "optional_packages_version": packages,
        "name": cfg.name,
        "task": f"3D {cfg.task} with {cfg.model.name}",
        "description": (
            f"{cfg.task.capitalize()} model '{cfg.name}' ({cfg.model.name}) trained with medseg on "
            f"{dataset_label(validation)}; runs with MONAI alone (configs/inference.json)"
        ),
        "authors": "medseg",
        "copyright": "Copyright (c) the medseg authors",
        # the dataset's folder: its base name unless data.share_paths (medseg.bundle.export.validation_data)
        "data_source": validation.get("dataset_dir", ""),
        "data_type": "nifti",
        "intended_use": "Research and development only; not for clinical decisions.",
        "image_classes": (
            f"one channel, oriented RAS, resampled to {list(t.spacing)} mm, intensities {intensity_text(cfg)}"
        ),
        "label_classes": ", ".join(f"{k} is {v}" for k, v in labels.items()),
        "pred_classes": f"{len(labels)} channels (logits), one per class; the label is the channel with the largest value",
        "preprocessing": _preprocessing_meta(cfg),
        "inference": _inference_meta(cfg),
        "torchscript": {"scriptable": torchscript_problem is None, "problem": torchscript_problem},
        "eval_metrics": metrics,
        "validated_on": {**validation, "best_epoch": epoch, "metrics": metrics},
        "network_data_format": {
            "inputs": {"image": _input_format(cfg, modality_of(validation))},
            "outputs": {"pred": _output_format(cfg, channel_def)},
        },
        "medseg_labels": channel_def,
        "medseg_metrics": metrics,
    }


def _packages(cfg: Config) -> dict[str, str]:
    """What inference.json needs besides MONAI, torch and numpy, with the installed versions: nibabel
    reads and writes NIfTI, the evaluator runs on ignite, `python -m monai.bundle` parses its
    arguments with fire; scipy smooths the classification object crop."""
    seg = cfg.task == "segmentation"
    needs = ("nibabel", "pytorch-ignite", "fire") + (
        ("scipy",) if not seg and cfg.transforms.roi == "object" else ()
    )
    return {name: _version(name) for name in needs}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def _preprocessing_meta(cfg: Config) -> dict[str, Any]:
    seg, t = cfg.task == "segmentation", cfg.transforms
    return {
        "orientation": "RAS",
        "spacing_mm": list(t.spacing),
        "spacing_interpolation": "bilinear",
        "intensity": _intensity_meta(cfg),
        "foreground_crop": False,  # training crops to the body; inference runs on the whole volume
        "resize_to": None if seg else list(t.patch),
        "classification_view": None if seg else t.roi,
    }


def _inference_meta(cfg: Config) -> dict[str, Any]:
    seg = cfg.task == "segmentation"
    return {
        "inferer": "sliding window" if seg else "whole volume",
        "roi_size": list(cfg.transforms.patch),
        "overlap": cfg.infer.overlap if seg else None,
        "blend_mode": cfg.infer.mode if seg else None,
        "output": "label map on the input's grid and affine (NIfTI, uint8)"
        if seg
        else f"class probabilities (CSV {CLS_FILENAME}: file, then one column per class in label order)",
    }


def _input_format(cfg: Config, modality: str) -> dict[str, Any]:
    return {
        "type": "image",
        "format": "hounsfield" if modality == "CT" else "magnitude",
        "modality": modality,
        "num_channels": 1,
        "spatial_shape": list(cfg.transforms.patch),
        "dtype": "float32",
        "value_range": _value_range(cfg),
        "is_patch_data": cfg.task == "segmentation",
        "channel_def": {"0": "image"},
    }


def _output_format(cfg: Config, channel_def: dict[str, str]) -> dict[str, Any]:
    seg, n = cfg.task == "segmentation", len(channel_def)
    return {
        "type": "image" if seg else "probabilities",
        "format": "labels" if seg else "classes",
        "modality": "n/a",
        "num_channels": n,
        "spatial_shape": list(cfg.transforms.patch) if seg else [n],
        "dtype": "float32",
        "value_range": [],
        "is_patch_data": seg,
        "channel_def": channel_def,
    }


def _intensity_meta(cfg: Config) -> dict[str, Any]:
    n, t = cfg.transforms.normalize, cfg.transforms
    if n.scheme == "zscore":
        return {"scheme": "zscore", "over": "non-zero voxels, per image"}
    if n.scheme == "ct":
        return {"scheme": "ct", "clip": list(n.clip), "mean": n.mean, "std": n.std}
    return {"scheme": "window", "window": list(t.window), "to_range": [0.0, 1.0], "clip": True}


def _value_range(cfg: Config) -> list[float]:
    n = cfg.transforms.normalize
    if n.scheme == "ct":
        return [(n.clip[0] - n.mean) / n.std, (n.clip[1] - n.mean) / n.std]
    return [] if n.scheme == "zscore" else [0, 1]
