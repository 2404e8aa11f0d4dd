"""Install the emulation that a test or benchmark asked for in the environment.

``MEDSEG_STRAGGLER=RANK:FACTOR`` makes that rank's compute ``FACTOR`` times slower
(:class:`~medseg.distributed.testbed.straggler.Straggler`); ``MEDSEG_FAULT_SLOW=PHASE:RANK:SECONDS``
(comma-separated, e.g. ``load:1:40``) makes that rank spend that long more in that phase, once, as a
slow disk or a long validation would. ``MEDSEG_FAULT_POISON=RANK:EPOCH:HOW`` makes that rank a faulty
or hostile site from the first step of that epoch on, once: its model's parameters become NaN
(``nan``) or 1000 times themselves (``x1000``), so the next update it sends is one the others must
refuse. All reach every rank through the launcher's environment. The command line calls
:func:`install_from_env` once at a rank's start; this is the only place that reads these variables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from medseg.distributed import emulation
from medseg.distributed.testbed.straggler import Straggler
from medseg.errors import ConfigError

log = logging.getLogger(__name__)
ENV_VARS = ("MEDSEG_STRAGGLER", "MEDSEG_FAULT_SLOW", "MEDSEG_FAULT_POISON")
POISONS = ("nan", "x1000")


def parse_fault_slow(spec: str) -> list[tuple[str, int, float]]:
    """``PHASE:RANK:SECONDS[,...]`` -> ``[(phase, rank, seconds), ...]``; a malformed item raises."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        try:
            phase, rank, seconds = parts[0], int(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            raise ConfigError(
                f"MEDSEG_FAULT_SLOW: {item!r}: expected PHASE:RANK:SECONDS, e.g. load:1:40"
            ) from None
        if len(parts) != 3 or seconds < 0:
            raise ConfigError(f"MEDSEG_FAULT_SLOW: {item!r}: expected PHASE:RANK:SECONDS with SECONDS >= 0")
        out.append((phase, rank, seconds))
    return out


def parse_fault_poison(spec: str) -> tuple[int, int, str] | None:
    """``RANK:EPOCH:HOW`` -> ``(rank, epoch, how)``; empty -> None; a malformed spec raises."""
    if not spec.strip():
        return None
    rank, _, rest = spec.strip().partition(":")
    epoch, _, how = rest.partition(":")
    if not (rank.isdigit() and epoch.isdigit() and int(epoch) >= 1 and how in POISONS):
        raise ConfigError(
            f"MEDSEG_FAULT_POISON: {spec!r}: expected RANK:EPOCH:HOW with HOW one of {', '.join(POISONS)}, e.g. 1:2:x1000"
        )
    return int(rank), int(epoch), how


class EnvEmulation(emulation.Emulation):
    """A straggler, phase delays and a spoiled model, as the environment names them."""

    def __init__(self, straggler: str | None, fault_slow: str, poison: str = "") -> None:
        self.straggler_spec = straggler
        self.delays = parse_fault_slow(fault_slow)
        self.poison = parse_fault_poison(poison)
        self._stragglers: dict[int, Straggler] = {}
        self._done: set[tuple[str, int]] = set()

    @property
    def slept_s(self) -> float:  # type: ignore[override]
        return sum(s.slept_s for s in self._stragglers.values())

    @contextlib.contextmanager
    def compute(self, rank: int) -> Iterator[None]:
        if rank not in self._stragglers:
            self._stragglers[rank] = Straggler.for_rank(self.straggler_spec, rank)
        with self._stragglers[rank]:
            yield

    def enter_phase(self, phase: str, rank: int) -> None:
        if (phase, rank) in self._done:
            return
        self._done.add((phase, rank))
        for what, r, seconds in self.delays:
            if what == phase and r == rank:
                log.info("fault injection: rank %d spends %g s more in %s", rank, seconds, phase)
                time.sleep(seconds)

    def after_step(self, rank: int, epoch: int, model: Any) -> None:
        if self.poison is None or model is None or self.poison[:2] != (rank, epoch):
            return
        how = self.poison[2]
        self.poison = None  # once
        log.info("fault injection: rank %d's model parameters become %s in epoch %d", rank, how, epoch)
        with torch.no_grad():
            for p in model.parameters():
                if how == "nan":
                    p.fill_(float("nan"))
                else:
                    p.mul_(1000.0)


def install_from_env() -> None:
    """Install :class:`EnvEmulation` when any variable is set; otherwise leave the engine as it is."""
    straggler, fault_slow = os.environ.get("MEDSEG_STRAGGLER"), os.environ.get("MEDSEG_FAULT_SLOW", "")
    poison = os.environ.get("MEDSEG_FAULT_POISON", "")
    if straggler or fault_slow or poison:
        emulation.install(EnvEmulation(straggler, fault_slow, poison))
