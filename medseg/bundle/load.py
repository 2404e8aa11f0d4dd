"""Reading a MONAI bundle back: the network rebuilt from ``network_def``, its weights
(``weights_only=True``), its labels and medseg's training config.

A bundle is data, never code. Every file is read as plain JSON or with ``torch.load(weights_only=True)``;
``network_def`` must name one of the networks medseg builds (:data:`medseg.models.NETWORKS`) with
literal arguments, and is built by medseg's own code (:func:`medseg.models.build_network`): a ``$``
expression, an ``@`` reference or any other ``_target_`` is refused with :class:`UnsafeBundleError`
before the weights are read. ``load_bundle(path, trust=True)`` (``--trust-bundle``) lifts that check for
a bundle its user made: MONAI's ``ConfigParser`` then builds ``network_def``, evaluating what it holds.
Nothing else in ``configs/inference.json`` (the MONAI workflow that ``python -m monai.bundle run``
executes) is read by medseg, with or without trust.

medseg's preprocessing is rebuilt from ``configs/medseg.json``; bundles without that file hold the
same mapping as a ``medseg`` block inside ``configs/inference.json``, and both are read as typed
config values (:func:`medseg.config.config_from_dict`), never evaluated.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medseg.config import Config, config_from_dict
from medseg.errors import ConfigError, RunError
from medseg.models import build_network, check_network_def

log = logging.getLogger(__name__)

SETTINGS = Path("configs") / "medseg.json"
INFERENCE = Path("configs") / "inference.json"
SITE_LOCAL = "site_local.pt"


class UnsafeBundleError(RunError):
    """A bundle's ``network_def`` asks for more than a listed network with literal arguments."""


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
    return json.loads((root / INFERENCE).read_text())["medseg"]


def read_network_def(root: str | Path, trust: bool = False) -> dict[str, Any]:
    """``network_def`` of the bundle folder ``root``'s ``configs/inference.json``, read as plain JSON.

    Unless ``trust``, checked as :func:`medseg.models.check_network_def` does: a listed network with
    literal arguments, else :class:`UnsafeBundleError` naming the file and the offending key."""
    path = Path(root) / INFERENCE
    try:
        inference = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise RunError(
            f"{path}: cannot be read as JSON ({type(exc).__name__}: {exc}); export the bundle again by training"
        ) from None
    if not isinstance(inference, dict) or "network_def" not in inference:
        raise RunError(f"{path}: has no 'network_def'; export the bundle again by training")
    definition = inference["network_def"]
    if trust:
        log.warning("%s: trusted; network_def is built by MONAI's ConfigParser, expressions included", path)
        return definition
    try:
        check_network_def(definition)
    except ConfigError as exc:
        raise UnsafeBundleError(
            f"{path}: refused, {exc}. medseg builds only the networks it exports, from literal "
            "arguments, and never runs code from a bundle. If you made this bundle yourself and trust "
            "it, pass --trust-bundle (load_bundle(..., trust=True))."
        ) from None
    return definition


def load_bundle(path: str | Path, device: str | torch.device = "cpu", trust: bool = False) -> Bundle:
    """Rebuild the network of a bundle and load its weights (``weights_only=True``).

    ``network_def`` is checked (:func:`read_network_def`) before anything else is built or read;
    ``trust=True`` builds it with MONAI's ``ConfigParser`` instead, for the user's own bundles."""
    root = find_bundle(path)
    definition = read_network_def(root, trust=trust)
    try:
        metadata = json.loads((root / "configs" / "metadata.json").read_text())
        if not isinstance(metadata, dict):
            raise ValueError("configs/metadata.json is not a JSON object")
        cfg = config_from_dict(read_settings(root))
        model = build_network(definition, trust=trust)
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
        RecursionError,
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
