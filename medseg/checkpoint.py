"""Checkpoints: written whole or not at all, loadable with ``torch.load(weights_only=True)``.

A checkpoint holds the model and optimizer (and scheduler) state, the epoch it completed, the best
validation metric so far, the RNG states of python, numpy and torch, the resolved config and the
label names. RNG states are stored as plain lists and tensors so that no pickle is needed to read
them back.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medseg.errors import RunError


def rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))


def save_checkpoint(payload: dict[str, Any], path: str | Path) -> Path:
    """``torch.save`` to a temporary name beside ``path``, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RunError(f"{path}: checkpoint not found; train first, or check the run name")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise RunError(
            f"{path}: checkpoint cannot be read ({type(exc).__name__}: {exc}); it may be truncated"
        ) from None
