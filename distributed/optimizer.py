"""Optimizer wrapping by synchronisation mode."""

from __future__ import annotations

import torch

from medseg.errors import ConfigError

SYNC_MODES = ("none",)


def wrap_optimizer(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, sync: str = "none"
) -> torch.optim.Optimizer:
    """Return the optimizer the training loop steps, wrapped for the synchronisation mode ``sync``.

    ``none`` trains in one process and returns ``optimizer`` unchanged.
    """
    if sync not in SYNC_MODES:
        raise ConfigError(f"train.sync: unknown mode {sync!r}; allowed: {', '.join(SYNC_MODES)}")
    return optimizer
