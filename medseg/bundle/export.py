"""Trained models as MONAI bundles: the one way a model leaves a run and reaches inference or the viewer.

Layout (MONAI bundle specification)::

    bundle/
      configs/metadata.json    versions, task, labels, input/output format, preprocessing, validation data
      configs/inference.json   a complete MONAI inference workflow (MONAI components only)
      configs/medseg.json      the resolved training config, read by medseg's own inference and viewer
      models/model.pt          state_dict only, read with torch.load(weights_only=True)
      docs/README.md           inputs, outputs, intended use, validation data, limits, how to run

``inference.json`` runs by itself with ``python -m monai.bundle run``: it reads NIfTI files, applies
the same preprocessing as :func:`medseg.training.transforms.preprocess` (RAS, resampling, intensity window),
runs the network with the inferer medseg uses, and writes label maps inverted back onto each input's
grid (``Invertd``, ``SaveImaged``) or class probabilities as CSV. It never imports medseg.

A bundle is made to leave the site, so by default it names no case file and no absolute path:
``metadata.json`` and the README give the dataset's name, its folder's base name and case counts,
and ``medseg.json`` holds the training config with ``data.dir``, ``data.cache_dir``, ``sites.*.dir``
and ``runs_dir`` cut to their base names (:func:`shareable_settings`). ``data.share_paths: true``
opts in to the validation cases' file names and the full paths. ``medseg evaluate``'s per-case
``eval-*.json`` is written beside the bundle, never into it. The run folder's own ``config.yaml``
keeps the full paths for this machine.
:mod:`medseg.bundle.metadata` writes ``metadata.json``, :mod:`medseg.bundle.readme` the README, and
:mod:`medseg.bundle.load` reads a bundle back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from medseg.bundle.load import SETTINGS, SITE_LOCAL
from medseg.bundle.metadata import CLS_FILENAME, SEG_POSTFIX, metadata
from medseg.bundle.readme import readme
from medseg.config import Config
from medseg.errors import MedsegError
from medseg.models import build_network, network_def

log = logging.getLogger(__name__)


# medseg.training.transforms.ObjectMask as one MONAI config expression (inference.json never imports medseg):
# Gaussian smoothing (sigma 1 voxel) per channel, then voxels above the Otsu threshold of 256 bins.
OBJECT_MASK_EXPR = (
    "$lambda img: (lambda s: torch.as_tensor(s > (lambda h, e: (lambda p, c: (lambda w, mu: "
    "e[int(numpy.argmax(numpy.where((w > 0) & (w < 1), (mu[-1] * w - mu) ** 2 / numpy.clip(w * (1 - w), "
    "1e-300, None), -1.0))) + 1])(numpy.cumsum(p), numpy.cumsum(p * c)))(h / max(h.sum(), 1), "
    "(e[:-1] + e[1:]) / 2))(*numpy.histogram(s, bins=256))))(numpy.stack([__import__('scipy.ndimage', "
    "fromlist=['gaussian_filter']).gaussian_filter("
    "numpy.asarray(ch, dtype=numpy.float32), sigma=1.0) for ch in numpy.asarray(img)]))"
)


def _intensity_step(cfg: Config) -> dict[str, Any]:
    """MONAI's form of :func:`medseg.training.transforms.intensity` (the same transform and numbers)."""
    n, t = cfg.transforms.normalize, cfg.transforms
    if n.scheme == "zscore":
        return {"_target_": "NormalizeIntensityd", "keys": "image", "nonzero": True, "channel_wise": True}
    if n.scheme == "ct":
        lo, hi = n.clip
        a_min, a_max, b_min, b_max = lo, hi, (lo - n.mean) / n.std, (hi - n.mean) / n.std
    else:
        a_min, a_max, b_min, b_max = t.window[0], t.window[1], 0.0, 1.0
    return {
        "_target_": "ScaleIntensityRanged",
        "keys": "image",
        "a_min": a_min,
        "a_max": a_max,
        "b_min": b_min,
        "b_max": b_max,
        "clip": True,
    }


def preprocessing(cfg: Config) -> dict[str, Any]:
    """MONAI's form of :func:`medseg.training.transforms.preprocess` after medseg's loader (NIfTI via nibabel)."""
    t = cfg.transforms
    chain: list[dict[str, Any]] = [
        {"_target_": "LoadImaged", "keys": "image", "reader": "NibabelReader", "image_only": True},
        {"_target_": "EnsureChannelFirstd", "keys": "image"},
        {"_target_": "Orientationd", "keys": "image", "axcodes": "RAS"},
        {"_target_": "Spacingd", "keys": "image", "pixdim": list(t.spacing), "mode": "bilinear"},
        _intensity_step(cfg),
    ]
    if cfg.task == "classification" and t.roi == "object":
        chain += [
            {
                "_target_": "CropForegroundd",
                "keys": "image",
                "source_key": "image",
                "select_fn": "@medseg_object_mask",
                "margin": 2,
                "allow_smaller": True,
            },
            {
                "_target_": "Resized",
                "keys": "image",
                "spatial_size": min(t.patch),
                "size_mode": "longest",
                "mode": "trilinear",
            },
        ]
    if cfg.task == "classification":
        chain.append({"_target_": "ResizeWithPadOrCropd", "keys": "image", "spatial_size": list(t.patch)})
    chain.append({"_target_": "EnsureTyped", "keys": "image", "track_meta": True})
    return {"_target_": "Compose", "transforms": chain}


def _postprocessing(cfg: Config) -> dict[str, Any]:
    """Softmax; for segmentation, probabilities inverted onto the input grid, then argmax, as medseg does."""
    chain: list[dict[str, Any]] = [{"_target_": "Activationsd", "keys": "pred", "softmax": True}]
    if cfg.task == "segmentation":
        chain += [
            # Inverting the probabilities (bilinear) before the argmax is what medseg.inference.predict.predict does;
            # inverting a label map instead would need nearest interpolation and gives other borders.
            {
                "_target_": "Invertd",
                "keys": "pred",
                "transform": "@preprocessing",
                "orig_keys": "image",
                "nearest_interp": False,
                "to_tensor": True,
            },
            {"_target_": "AsDiscreted", "keys": "pred", "argmax": True},
            {
                "_target_": "SaveImaged",
                "keys": "pred",
                "output_dir": "@output_dir",
                "output_postfix": "@output_postfix",
                "output_ext": "@output_ext",
                "output_dtype": "$numpy.uint8",
                "resample": False,
                "separate_folder": False,
                "print_log": False,
            },
        ]
    return {"_target_": "Compose", "transforms": chain}


def _inferer(cfg: Config) -> dict[str, Any]:
    """The inferer medseg uses: sliding windows for segmentation, the whole volume for classification."""
    if cfg.task == "segmentation":
        return {
            "_target_": "SlidingWindowInferer",
            "roi_size": list(cfg.transforms.patch),
            "sw_batch_size": cfg.infer.sw_batch_size,
            "overlap": cfg.infer.overlap,
            "mode": cfg.infer.mode,
        }
    return {"_target_": "SimpleInferer"}


def _handlers(cfg: Config) -> list[Any]:
    """Load the weights, log, and for classification write the probabilities as CSV."""
    handlers: list[Any] = [
        {
            "_target_": "CheckpointLoader",
            "load_path": "$@bundle_root + '/models/model.pt'",
            "load_dict": {"model": "@network"},
            "map_location": "@device",
        },
        {"_target_": "StatsHandler", "iteration_log": False},
    ]
    if cfg.task != "segmentation":
        handlers.append(
            {
                "_target_": "ClassificationSaver",
                "output_dir": "@output_dir",
                "filename": CLS_FILENAME,
                "batch_transform": "$lambda batch: [item['image'].meta for item in batch]",
                "output_transform": "$lambda output: [item['pred'] for item in output]",
            }
        )
    return handlers


def _inference_config(cfg: Config, net: dict[str, Any]) -> dict[str, Any]:
    """The whole ``configs/inference.json``: a MONAI evaluator over NIfTI inputs, MONAI components only."""
    seg = cfg.task == "segmentation"
    return {
        "imports": ["$import glob", "$import logging", "$import os", "$import numpy", "$import torch"],
        "bundle_root": ".",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        # Inputs: every NIfTI file in dataset_dir, or `input` (one path or a list of paths) when given.
        "dataset_dir": "$@bundle_root + '/data'",
        "input": "",
        "datalist": (
            "$[{'image': f} for f in ([@input] if isinstance(@input, str) else list(@input))] if @input "
            "else [{'image': f} for f in sorted(glob.glob(os.path.join(@dataset_dir, '*.nii*')))]"
        ),
        "output_dir": "$@bundle_root + '/eval'",
        **({"output_postfix": SEG_POSTFIX, "output_ext": ".nii.gz"} if seg else {}),
        "num_workers": 0,
        "network_def": net,
        "network": "$@network_def.to(@device)",
        **({"medseg_object_mask": OBJECT_MASK_EXPR} if not seg and cfg.transforms.roi == "object" else {}),
        "preprocessing": preprocessing(cfg),
        "dataset": {"_target_": "Dataset", "data": "@datalist", "transform": "@preprocessing"},
        "dataloader": {
            "_target_": "DataLoader",
            "dataset": "@dataset",
            "batch_size": 1,
            "shuffle": False,
            "num_workers": "@num_workers",
        },
        "inferer": _inferer(cfg),
        "postprocessing": _postprocessing(cfg),
        "handlers": _handlers(cfg),
        "evaluator": {
            "_target_": "SupervisedEvaluator",
            "device": "@device",
            "val_data_loader": "@dataloader",
            "network": "@network",
            "inferer": "@inferer",
            "postprocessing": "@postprocessing",
            "val_handlers": "@handlers",
            # Mixed precision on CUDA only, as in training.
            "amp": "$@device.type == 'cuda'" if cfg.train.amp else False,
        },
        "initialize": ["$monai.utils.set_determinism(seed=0)"],
        "run": ["$@evaluator.run()"],
        "finalize": ["$logging.getLogger('bundle').info('outputs written to %s', @output_dir)"],
    }


def _torchscript_problem(net: dict[str, Any], weights: dict[str, torch.Tensor]) -> str | None:
    """None when ``torch.jit.script`` accepts the network (what ``monai.bundle ckpt_export`` does), else why not."""
    try:
        model = build_network(net)
        model.load_state_dict(weights)
        torch.jit.script(model.eval())
    except Exception as exc:  # noqa: BLE001 - any failure is reported in the bundle, not raised
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}"[:300]
    return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


WITHHELD = "withheld"  # stands for each validation case's file name when data.share_paths is false


def base_name(path: str) -> str:
    """The last component of a folder path (``/data/hospital/liver`` -> ``liver``); "" stays ""."""
    if not path:
        return ""
    return Path(path).name or Path(path).resolve().name or "data"


def shareable_settings(cfg: Config) -> dict[str, Any]:
    """``configs/medseg.json``: the training config, with every local folder cut to its base name
    unless ``data.share_paths`` (the run's own ``config.yaml`` keeps them whole)."""
    settings = cfg.to_dict()
    if cfg.data.share_paths:
        return settings
    settings["runs_dir"] = base_name(settings["runs_dir"])
    settings["data"]["dir"] = base_name(settings["data"]["dir"])
    settings["data"]["cache_dir"] = base_name(settings["data"]["cache_dir"])
    for site in settings["sites"].values():
        site["dir"] = base_name(site["dir"])
    return settings


def validation_data(cfg: Config) -> dict[str, Any]:
    """The dataset, split and cases the exported weights were selected on (best validation epoch).

    Case file names and the dataset's full path only with ``data.share_paths``; otherwise ``cases``
    holds one :data:`WITHHELD` per validation case (readers count it) and ``num_validation_cases``
    the count."""
    from medseg.datasets.decathlon import load_dataset, split_train_val

    share = cfg.data.share_paths
    info: dict[str, Any] = {
        "dataset_dir": cfg.data.dir if share else base_name(cfg.data.dir),
        "val_fraction": cfg.data.val_fraction,
        "split_seed": cfg.train.seed,
    }
    try:
        dataset = load_dataset(cfg.data.dir)
    except MedsegError as exc:  # the bundle is still useful without the case list
        log.warning("bundle: validation cases not listed (%s)", exc)
        return info
    _, val = split_train_val(dataset.training, cfg.data.val_fraction, cfg.train.seed)
    info.update(
        dataset_name=dataset.name,
        modality=dataset.modality,
        num_training_cases=len(dataset.training) - len(val),
        num_validation_cases=len(val),
        case_names="listed" if share else "withheld (data.share_paths: false)",
        cases=[Path(item["image"]).name if share else WITHHELD for item in val],
    )
    return info


def export_bundle(cfg: Config, state: dict[str, Any], metrics: dict[str, Any]) -> Path:
    """Write ``<run>/bundle`` from a checkpoint ``state``; the old bundle is replaced only when the new one is whole."""
    labels = {int(k): v for k, v in state["labels"].items()}
    net = network_def(cfg, out_channels=len(labels))
    validation = validation_data(cfg)
    problem = _torchscript_problem(net, state["model"])
    if problem:
        log.warning(
            "bundle: %s cannot be exported to TorchScript (%s); noted in docs/README.md",
            cfg.model.name,
            problem,
        )
    dest = cfg.run_dir / "bundle"
    tmp = cfg.run_dir / f".bundle.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    meta = metadata(cfg, labels, metrics, state["epoch"], validation, problem)
    _write_json(tmp / "configs" / "metadata.json", meta)
    _write_json(tmp / "configs" / "inference.json", _inference_config(cfg, net))
    _write_json(tmp / SETTINGS, shareable_settings(cfg))
    (tmp / "models").mkdir()
    torch.save(state["model"], tmp / "models" / "model.pt")
    if state.get("site_local"):
        # dist.local_norm: each site's own normalisation tensors ({site: {name: tensor}}); model.pt
        # holds rank 0's site's. `medseg evaluate --data SITE=DIR` swaps in that site's.
        torch.save(state["site_local"], tmp / "models" / SITE_LOCAL)
    (tmp / "docs").mkdir()
    (tmp / "docs" / "README.md").write_text(readme(cfg, labels, metrics, state["epoch"], validation, problem))
    old = cfg.run_dir / f".bundle.old-{os.getpid()}"
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest
