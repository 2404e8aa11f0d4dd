"""Install the emulation that a test or benchmark asked for in the environment.

``MEDSEG_STRAGGLER=RANK:FACTOR`` makes that rank's compute ``FACTOR`` times slower
(:class:`~medseg.distributed.testbed.straggler.Straggler`); ``MEDSEG_FAULT_SLOW=PHASE:RANK:SECONDS``
(comma-separated, e.g. ``load:1:40``) makes that rank spend that long more in that phase, once, as a
slow disk or a long validation would. Both reach every rank through the launcher's environment.
The command line calls :func:`install_from_env` once at a rank's start; this is the only place that
reads either variable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from medseg.distributed import emulation
from medseg.distributed.testbed.straggler import Straggler
from medseg.errors import ConfigError

log = logging.getLogger(__name__)
ENV_VARS = ("MEDSEG_STRAGGLER", "MEDSEG_FAULT_SLOW")


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


class EnvEmulation(emulation.Emulation):
    """A straggler and phase delays, as the environment names them."""

    def __init__(self, straggler: str | None, fault_slow: str) -> None:
        self.straggler_spec = straggler
        self.delays = parse_fault_slow(fault_slow)
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


def install_from_env() -> None:
    """Install :class:`EnvEmulation` when either variable is set; otherwise leave the engine as it is."""
    straggler, fault_slow = os.environ.get("MEDSEG_STRAGGLER"), os.environ.get("MEDSEG_FAULT_SLOW", "")
    if straggler or fault_slow:
        emulation.install(EnvEmulation(straggler, fault_slow))
