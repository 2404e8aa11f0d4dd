"""Trained models as MONAI bundles: the one way a model leaves a run and reaches inference or the viewer.

Layout (MONAI bundle specification)::

    bundle/
      configs/metadata.json    versions, task, labels, input/output format, validation metrics
      configs/inference.json   network_def (MONAI config syntax), inferer, medseg preprocessing settings
      models/model.pt          state_dict only, read with torch.load(weights_only=True)
      docs/README.md

The network is rebuilt from ``network_def`` with MONAI's ``ConfigParser``; preprocessing is rebuilt
from the ``medseg`` section, which holds the training config's task, transforms and infer settings.
"""

from __future__ import annotations

import json
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
from medseg.errors import ConfigError, RunError
from medseg.models import build_network, network_def

SCHEMA = (
    "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/meta_schema_20220324.json"
)


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


def _metadata(cfg: Config, labels: dict[int, str], metrics: dict[str, Any], epoch: int) -> dict[str, Any]:
    seg = cfg.task == "segmentation"
    n = len(labels)
    return {
        "schema": SCHEMA,
        "version": "0.1.0",
        "changelog": {"0.1.0": f"trained by medseg {__version__}, run {cfg.name}, best epoch {epoch}"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": np.__version__,
        "optional_packages_version": {
            "nibabel": __import__("nibabel").__version__,
            "pydicom": __import__("pydicom").__version__,
        },
        "required_packages_version": {"medseg": __version__},
        "name": cfg.name,
        "task": f"3D {cfg.task} with {cfg.model.name}",
        "description": f"medseg {cfg.task} model '{cfg.name}' ({cfg.model.name}), trained on {cfg.data.dir}",
        "authors": "medseg",
        "copyright": "Copyright (c) the medseg authors",
        "data_source": cfg.data.dir,
        "intended_use": "Research and development only; not for clinical decisions.",
        "network_data_format": {
            "inputs": {
                "image": {
                    "type": "image",
                    "format": "hounsfield" if cfg.transforms.window[0] < 0 else "magnitude",
                    "modality": "CT",
                    "num_channels": 1,
                    "spatial_shape": list(cfg.transforms.patch),
                    "dtype": "float32",
                    "value_range": [0, 1],
                    "is_patch_data": seg,
                    "channel_def": {"0": "image"},
                }
            },
            "outputs": {
                "pred": {
                    "type": "image" if seg else "probabilities",
                    "format": "segmentation" if seg else "classes",
                    "num_channels": n,
                    "spatial_shape": list(cfg.transforms.patch) if seg else [n],
                    "dtype": "float32",
                    "value_range": [0, 1],
                    "is_patch_data": seg,
                    "channel_def": {str(k): v for k, v in labels.items()},
                }
            },
        },
        "medseg_labels": {str(k): v for k, v in labels.items()},
        "medseg_metrics": metrics,
    }


def _inference_config(cfg: Config, net: dict[str, Any]) -> dict[str, Any]:
    return {
        "imports": ["$import torch", "$import monai"],
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "network_def": net,
        "network": "$@network_def.to(@device)",
        "inferer": {
            "_target_": "SlidingWindowInferer",
            "roi_size": list(cfg.transforms.patch),
            "sw_batch_size": cfg.infer.sw_batch_size,
            "overlap": cfg.infer.overlap,
            "mode": cfg.infer.mode,
        },
        "medseg": cfg.to_dict(),
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def export_bundle(cfg: Config, state: dict[str, Any], metrics: dict[str, Any]) -> Path:
    """Write ``<run>/bundle`` from a checkpoint ``state``; the old bundle is replaced only when the new one is whole."""
    labels = {int(k): v for k, v in state["labels"].items()}
    net = network_def(cfg, out_channels=len(labels))
    dest = cfg.run_dir / "bundle"
    tmp = cfg.run_dir / f".bundle.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _write_json(tmp / "configs" / "metadata.json", _metadata(cfg, labels, metrics, state["epoch"]))
    _write_json(tmp / "configs" / "inference.json", _inference_config(cfg, net))
    (tmp / "models").mkdir()
    torch.save(state["model"], tmp / "models" / "model.pt")
    (tmp / "docs").mkdir()
    shown = "\n".join(
        f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in metrics.items()
    )
    names = ", ".join(f"{k}={v}" for k, v in labels.items())
    (tmp / "docs" / "README.md").write_text(
        f"# {cfg.name}\n\nmedseg {cfg.task} model ({cfg.model.name}) trained on `{cfg.data.dir}`.\n\n"
        f"Labels: {names}.\n\nInput: one CT channel, resampled to {cfg.transforms.spacing} mm (RAS), "
        f"intensities windowed from {cfg.transforms.window[0]} to {cfg.transforms.window[1]} onto [0, 1].\n\n"
        f"Validation (best epoch {state['epoch']}):\n{shown or '- none'}\n\n"
        "Run it with `medseg infer --run <run folder> --input scan.nii.gz --output mask.nii.gz` "
        "or open it in the viewer. Research use only.\n"
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


def load_bundle(path: str | Path, device: str | torch.device = "cpu") -> Bundle:
    """Rebuild the network of a bundle and load its weights (``weights_only=True``)."""
    root = find_bundle(path)
    try:
        metadata = json.loads((root / "configs" / "metadata.json").read_text())
        inference = json.loads((root / "configs" / "inference.json").read_text())
        cfg = config_from_dict(inference["medseg"])
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
