"""The one seam through which test-only emulation reaches the engine.

A heterogeneous cluster, a slow disk or a long validation are hard to come by in CI, so tests and
benchmarks emulate them. They do so by installing an :class:`Emulation` in the rank's process before
training starts (:mod:`medseg.distributed.testbed.emulate` does it from the environment); the
engine only asks the installed one. Nothing here reads the environment or knows what is emulated,
and with nothing installed every hook is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class Emulation:
    """What a rank's session asks at its hook points; this base class emulates nothing."""

    slept_s: float = 0.0  # total delay injected into this rank's compute so far

    @contextlib.contextmanager
    def compute(self, rank: int) -> Iterator[None]:
        """Wraps one training step's forward and backward pass of ``rank``."""
        yield

    def enter_phase(self, phase: str, rank: int) -> None:
        """Called when ``rank`` enters a phase (``load``, ``validate``, ...)."""

    def after_step(self, rank: int, epoch: int, model: Any) -> None:
        """Called after each optimizer step of ``rank`` with its model (a faulty site's can be spoiled here)."""


_installed = Emulation()


def install(emulation: Emulation) -> None:
    """Make ``emulation`` the one this process's sessions use."""
    global _installed
    _installed = emulation


def current() -> Emulation:
    """The installed emulation (a no-op one unless a test or benchmark installed another)."""
    return _installed
