"""Reading a MONAI bundle back: the network rebuilt from ``network_def`` with MONAI's ``ConfigParser``,
its weights (``weights_only=True``), its labels and medseg's training config.

medseg's preprocessing is rebuilt from ``configs/medseg.json``; bundles without that file hold the
same mapping as a ``medseg`` block inside ``configs/inference.json``, and both are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medseg.config import Config, config_from_dict
from medseg.errors import ConfigError, RunError
from medseg.models import build_network

SETTINGS = Path("configs") / "medseg.json"
SITE_LOCAL = "site_local.pt"


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
    """The training config a bundle was exported with: ``configs/medseg.json``, or in bundles without
    that file, the ``medseg`` block of ``configs/inference.json``."""
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
