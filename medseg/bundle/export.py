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

medseg rebuilds the network from ``network_def`` with MONAI's ``ConfigParser`` and its preprocessing
from ``configs/medseg.json`` (bundles written before that file existed hold the same mapping as a
``medseg`` block inside ``inference.json``; both are read).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import monai
import numpy as np
import torch

from medseg import __version__
from medseg.config import Config, config_from_dict
from medseg.errors import ConfigError, MedsegError, RunError
from medseg.models import build_network, network_def

log = logging.getLogger(__name__)

SCHEMA = (
    "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/meta_schema_20240725.json"
)
SETTINGS = Path("configs") / "medseg.json"
SEG_POSTFIX = "seg"
CLS_FILENAME = "predictions.csv"
SITE_LOCAL = "site_local.pt"


def site_names(bundle: Bundle) -> list[str]:
    """Sites whose own normalisation tensors the bundle holds (trained with dist.local_norm)."""
    path = bundle.path / "models" / SITE_LOCAL
    if not path.is_file():
        return []
    return sorted(torch.load(path, map_location="cpu", weights_only=True))


def use_site(bundle: Bundle, site: str) -> None:
    """Load site ``site``'s own normalisation tensors into the bundle's model (local_norm bundles)."""
    per_site = torch.load(bundle.path / "models" / SITE_LOCAL, map_location="cpu", weights_only=True)
    if site not in per_site:
        raise RunError(f"{bundle.path}: holds normalisation state of sites {sorted(per_site)}, not {site!r}")
    missing = bundle.model.load_state_dict(per_site[site], strict=False).unexpected_keys
    if missing:
        raise RunError(f"{bundle.path}: {SITE_LOCAL} names tensors the network lacks: {missing[:3]}")


@dataclass
class Bundle:
    path: Path
    model: torch.nn.Module
    config: Config
    labels: dict[int, str]
    metadata: dict[str, Any]

    @property
    def task(self) -> str:
        return self.config.task

    @property
    def name(self) -> str:
        return self.metadata.get("name", self.path.parent.name)


def _validation_data(cfg: Config) -> dict[str, Any]:
    """The dataset, split and cases the exported weights were selected on (best validation epoch)."""
    from medseg.datasets.decathlon import load_dataset, split_train_val

    info: dict[str, Any] = {
        "dataset_dir": cfg.data.dir,
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
        cases=[Path(item["image"]).name for item in val],
    )
    return info


def _modality(validation: dict[str, Any]) -> str:
    modality = validation.get("modality") or {}
    return str(modality.get("0", next(iter(modality.values()), "CT")))


def _metadata(
    cfg: Config,
    labels: dict[int, str],
    metrics: dict[str, Any],
    epoch: int,
    validation: dict[str, Any],
    torchscript_problem: str | None,
) -> dict[str, Any]:
    seg = cfg.task == "segmentation"
    t = cfg.transforms
    n = len(labels)
    modality = _modality(validation)
    channel_def = {str(k): v for k, v in labels.items()}
    needs = ("nibabel", "pytorch-ignite", "fire") + (("scipy",) if not seg and t.roi == "object" else ())
    packages = {name: _version(name) for name in needs}  # scipy: the object crop's smoothing
    return {
        "schema": SCHEMA,
        "version": "0.1.0",
        "changelog": {"0.1.0": f"trained by medseg {__version__}, run {cfg.name}, best epoch {epoch}"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": np.__version__,
        # What inference.json needs besides MONAI, torch and numpy: nibabel reads and writes NIfTI, the
        # evaluator runs on ignite, `python -m monai.bundle` parses its arguments with fire. The bundle
        # specification names this key `optional_packages_version`; MONAI 1.6 renames that to
        # `required_packages_version` on reading (the newer schema's key), so both hold the same list.
        "required_packages_version": packages,
        "optional_packages_version": packages,
        "name": cfg.name,
        "task": f"3D {cfg.task} with {cfg.model.name}",
        "description": (
            f"{cfg.task.capitalize()} model '{cfg.name}' ({cfg.model.name}) trained with medseg on "
            f"{validation.get('dataset_name', cfg.data.dir)}; runs with MONAI alone (configs/inference.json)"
        ),
        "authors": "medseg",
        "copyright": "Copyright (c) the medseg authors",
        "data_source": cfg.data.dir,
        "data_type": "nifti",
        "intended_use": "Research and development only; not for clinical decisions.",
        "image_classes": (
            f"one channel, oriented RAS, resampled to {list(t.spacing)} mm, intensities {intensity_text(cfg)}"
        ),
        "label_classes": ", ".join(f"{k} is {v}" for k, v in labels.items()),
        "pred_classes": f"{n} channels (logits), one per class; the label is the channel with the largest value",
        "preprocessing": {
            "orientation": "RAS",
            "spacing_mm": list(t.spacing),
            "spacing_interpolation": "bilinear",
            "intensity": _intensity_meta(cfg),
            "foreground_crop": False,  # training crops to the body; inference runs on the whole volume
            "resize_to": None if seg else list(t.patch),
            "classification_view": None if seg else t.roi,
        },
        "inference": {
            "inferer": "sliding window" if seg else "whole volume",
            "roi_size": list(t.patch),
            "overlap": cfg.infer.overlap if seg else None,
            "blend_mode": cfg.infer.mode if seg else None,
            "output": "label map on the input's grid and affine (NIfTI, uint8)"
            if seg
            else f"class probabilities (CSV {CLS_FILENAME}: file, then one column per class in label order)",
        },
        "torchscript": {"scriptable": torchscript_problem is None, "problem": torchscript_problem},
        "eval_metrics": metrics,
        "validated_on": {**validation, "best_epoch": epoch, "metrics": metrics},
        "network_data_format": {
            "inputs": {
                "image": {
                    "type": "image",
                    "format": "hounsfield" if modality == "CT" else "magnitude",
                    "modality": modality,
                    "num_channels": 1,
                    "spatial_shape": list(t.patch),
                    "dtype": "float32",
                    "value_range": _value_range(cfg),
                    "is_patch_data": seg,
                    "channel_def": {"0": "image"},
                }
            },
            "outputs": {
                "pred": {
                    "type": "image" if seg else "probabilities",
                    "format": "labels" if seg else "classes",
                    "modality": "n/a",
                    "num_channels": n,
                    "spatial_shape": list(t.patch) if seg else [n],
                    "dtype": "float32",
                    "value_range": [],
                    "is_patch_data": seg,
                    "channel_def": channel_def,
                }
            },
        },
        "medseg_labels": channel_def,
        "medseg_metrics": metrics,
    }


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


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


def _preprocessing(cfg: Config) -> dict[str, Any]:
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


def _inference_config(cfg: Config, net: dict[str, Any]) -> dict[str, Any]:
    seg = cfg.task == "segmentation"
    if seg:
        inferer: dict[str, Any] = {
            "_target_": "SlidingWindowInferer",
            "roi_size": list(cfg.transforms.patch),
            "sw_batch_size": cfg.infer.sw_batch_size,
            "overlap": cfg.infer.overlap,
            "mode": cfg.infer.mode,
        }
    else:
        inferer = {"_target_": "SimpleInferer"}
    handlers: list[Any] = [
        {
            "_target_": "CheckpointLoader",
            "load_path": "$@bundle_root + '/models/model.pt'",
            "load_dict": {"model": "@network"},
            "map_location": "@device",
        },
        {"_target_": "StatsHandler", "iteration_log": False},
    ]
    if not seg:
        handlers.append(
            {
                "_target_": "ClassificationSaver",
                "output_dir": "@output_dir",
                "filename": CLS_FILENAME,
                "batch_transform": "$lambda batch: [item['image'].meta for item in batch]",
                "output_transform": "$lambda output: [item['pred'] for item in output]",
            }
        )
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
        "preprocessing": _preprocessing(cfg),
        "dataset": {"_target_": "Dataset", "data": "@datalist", "transform": "@preprocessing"},
        "dataloader": {
            "_target_": "DataLoader",
            "dataset": "@dataset",
            "batch_size": 1,
            "shuffle": False,
            "num_workers": "@num_workers",
        },
        "inferer": inferer,
        "postprocessing": _postprocessing(cfg),
        "handlers": handlers,
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


def _readme(
    cfg: Config,
    labels: dict[int, str],
    metrics: dict[str, Any],
    epoch: int,
    validation: dict[str, Any],
    torchscript_problem: str | None,
) -> str:
    seg = cfg.task == "segmentation"
    t = cfg.transforms
    names = ", ".join(f"{k} = {v}" for k, v in labels.items())
    shown = "\n".join(
        f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in metrics.items()
    )
    cases = validation.get("cases")
    cases_line = (
        f"{len(cases)} held-out cases of `{validation.get('dataset_name', cfg.data.dir)}` "
        f"(`{cfg.data.dir}`, fraction {cfg.data.val_fraction}, split seed {cfg.train.seed}): "
        + ", ".join(cases)
        if cases
        else f"the validation split of `{cfg.data.dir}` (fraction {cfg.data.val_fraction})"
    )
    if seg:
        output = (
            f"`<output_dir>/<input name>_{SEG_POSTFIX}.nii.gz`: a uint8 label map ({names}) with the input's "
            "shape and affine. The class probabilities are computed on the resampled grid, mapped back onto "
            "the input grid (bilinear, `Invertd`) and then arg-maxed."
        )
        model_line = (
            f"sliding window {list(t.patch)}, overlap {cfg.infer.overlap}, {cfg.infer.mode} blending, "
            f"{cfg.infer.sw_batch_size} windows per batch"
        )
    else:
        output = (
            f"`<output_dir>/{CLS_FILENAME}`: one row per input, the file name followed by the softmax "
            f"probability of each class in label order ({names}); no header."
        )
        model_line = f"the whole volume, padded or cropped to {list(t.patch)} voxels"
    if torchscript_problem is None:
        ts = (
            "The network scripts with `torch.jit.script`, so MONAI can export it to TorchScript:\n\n"
            "```bash\npython -m monai.bundle ckpt_export network_def --filepath models/model.ts \\\n"
            "    --ckpt_file models/model.pt --meta_file configs/metadata.json "
            "--config_file configs/inference.json --bundle_root .\n```"
        )
    else:
        ts = (
            f"**TorchScript: this network ({cfg.model.name}) cannot be scripted** "
            f"(`torch.jit.script` fails with `{torchscript_problem}`), so `monai.bundle ckpt_export` "
            "does not work for it; use `models/model.pt` with `network_def`."
        )
    return f"""# {cfg.name}

{cfg.task.capitalize()} model ({cfg.model.name}) trained with medseg {__version__} on `{cfg.data.dir}`.
Research and development only; not for clinical decisions.

## Input

One 3D volume per case, one channel (modality {_modality(validation)}), as NIfTI (`.nii`, `.nii.gz`).
Preprocessing: orient to RAS, resample to {list(t.spacing)} mm (bilinear), intensities
{intensity_text(cfg)}{"" if seg else (f", the object's bounding box resized to fit {list(t.patch)} voxels" if t.roi == "object" else f", pad or crop to {list(t.patch)} voxels")}.
No foreground cropping at inference. The network sees {model_line}.

## Output

{output}

Labels: {names}.

## Validation

Weights of epoch {epoch}, chosen on {cases_line}.

{shown or "- no validation metrics"}

## Limits

- Trained on `{validation.get("dataset_name", cfg.data.dir)}`; other scanners, protocols, fields of view
  or anatomies are untested.
- `configs/inference.json` reads NIfTI with nibabel. DICOM series are read by medseg (`medseg infer`),
  which checks slice positions; convert them first (`medseg data convert`) to use MONAI alone.
- Intended for research use only; not a medical device.

## Running with MONAI alone (no medseg)

From this folder; needs `monai`, `torch`, `nibabel`, `pytorch-ignite` and `fire` (see `configs/metadata.json`).

```bash
python -m monai.bundle run --config_file configs/inference.json --bundle_root . \\
    --dataset_dir /path/to/niftis --output_dir /path/to/out
# or one file / a list of files:
python -m monai.bundle run --config_file configs/inference.json --bundle_root . \\
    --input /path/to/scan.nii.gz --output_dir /path/to/out
```

`--device "\\$torch.device('cpu')"` forces the CPU; `--num_workers 4` loads cases in parallel.

## TorchScript

{ts}

## With medseg

`medseg infer --run <run folder> --input scan.nii.gz --output mask.nii.gz`, `medseg evaluate`, or
the viewer (`medseg app`); medseg reads `configs/medseg.json` and gives the same result.
"""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def export_bundle(cfg: Config, state: dict[str, Any], metrics: dict[str, Any]) -> Path:
    """Write ``<run>/bundle`` from a checkpoint ``state``; the old bundle is replaced only when the new one is whole."""
    labels = {int(k): v for k, v in state["labels"].items()}
    net = network_def(cfg, out_channels=len(labels))
    validation = _validation_data(cfg)
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
    meta = _metadata(cfg, labels, metrics, state["epoch"], validation, problem)
    _write_json(tmp / "configs" / "metadata.json", meta)
    _write_json(tmp / "configs" / "inference.json", _inference_config(cfg, net))
    _write_json(tmp / SETTINGS, cfg.to_dict())
    (tmp / "models").mkdir()
    torch.save(state["model"], tmp / "models" / "model.pt")
    if state.get("site_local"):
        # dist.local_norm: each site's own normalisation tensors ({site: {name: tensor}}); model.pt
        # holds rank 0's site's. `medseg evaluate --data SITE=DIR` swaps in that site's.
        torch.save(state["site_local"], tmp / "models" / SITE_LOCAL)
    (tmp / "docs").mkdir()
    (tmp / "docs" / "README.md").write_text(
        _readme(cfg, labels, metrics, state["epoch"], validation, problem)
    )
    old = cfg.run_dir / f".bundle.old-{os.getpid()}"
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def find_bundle(path: str | Path) -> Path:
    """Accept a run folder or a bundle folder and return the bundle folder."""
    path = Path(path)
    for candidate in (path, path / "bundle"):
        if (candidate / "configs" / "metadata.json").is_file():
            return candidate
    raise RunError(
        f"{path}: no MONAI bundle here (expected bundle/configs/metadata.json); has the run finished training?"
    )


def read_settings(root: str | Path) -> dict[str, Any]:
    """The training config a bundle was exported with: ``configs/medseg.json``, or for bundles written
    before that file existed, the ``medseg`` block of ``configs/inference.json``."""
    root = Path(root)
    if (root / SETTINGS).is_file():
        return json.loads((root / SETTINGS).read_text())
    return json.loads((root / "configs" / "inference.json").read_text())["medseg"]


def load_bundle(path: str | Path, device: str | torch.device = "cpu") -> Bundle:
    """Rebuild the network of a bundle and load its weights (``weights_only=True``)."""
    root = find_bundle(path)
    try:
        metadata = json.loads((root / "configs" / "metadata.json").read_text())
        inference = json.loads((root / "configs" / "inference.json").read_text())
        cfg = config_from_dict(read_settings(root))
        model = build_network(inference["network_def"])
        weights = torch.load(root / "models" / "model.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(weights)
        if not isinstance(metadata.get("medseg_labels"), dict):
            raise KeyError("configs/metadata.json has no 'medseg_labels' object (label value -> name)")
        labels = {int(k): str(v) for k, v in metadata["medseg_labels"].items()}
    except (
        OSError,
        KeyError,
        ValueError,
        TypeError,
        AttributeError,
        ConfigError,
        RuntimeError,
        EOFError,
    ) as exc:
        raise RunError(
            f"{root}: bundle is damaged or incomplete ({type(exc).__name__}: {exc}); export it again by training"
        ) from None
    return Bundle(root, model.to(device).eval(), cfg, labels, metadata)
