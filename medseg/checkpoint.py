"""Checkpoints: written whole or not at all, loadable with ``torch.load(weights_only=True)``.

A checkpoint holds the model and optimizer (and scheduler) state, the epoch it completed, the best
validation metric so far, the RNG states of python, numpy and torch, the resolved config and the
label names. RNG states are stored as plain lists and tensors so that no pickle is needed to read
them back.

Every ``torch.load`` in medseg is ``weights_only=True``. MONAI's disk cache of preprocessed cases
(``data.cache: disk``) holds MetaTensors whose metadata carries NIfTI header fields as numpy arrays and
MONAI's ``TraceKeys`` enum; :func:`allow_cache_globals` adds exactly those to what a weights-only load
accepts (MONAI itself adds MetaTensor, MetaObj, MetaKeys and SpaceKeys when it is imported).
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


def cache_globals() -> list[Any]:
    """What a weights-only load of MONAI's disk cache needs beyond tensors: numpy's array
    reconstructor, ``numpy.ndarray``, ``numpy.dtype`` and its classes for bool, number, bytes and str
    (not object or void) arrays, and MONAI's ``TraceKeys`` enum (applied-operation keys)."""
    from monai.utils.enums import TraceKeys

    reconstruct = np.zeros(0).__reduce__()[0]  # numpy._core.multiarray._reconstruct (numpy 1 and 2)
    dtypes = {type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDGSU"}  # numpy.dtypes.*DType (numpy 2)
    return [reconstruct, np.ndarray, np.dtype, *sorted(dtypes - {np.dtype}, key=str), TraceKeys]


def allow_cache_globals() -> None:
    """Let ``torch.load(weights_only=True)`` in this process read MONAI's disk cache (:func:`cache_globals`)."""
    torch.serialization.add_safe_globals(cache_globals())


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
