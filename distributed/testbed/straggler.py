"""Straggler simulation: make one rank behave like a slower GPU, for tests and benchmarks.

A heterogeneous cluster is hard to come by in CI, so a rank can be slowed down on purpose:
``--straggler 3:2.0`` makes rank 3 take about twice as long per training step. The slowdown is
proportional to the step's own compute time (not a fixed delay), so it behaves like a device with
``1 / factor`` of the throughput whatever the model or batch size, and profiling, grouping and the
staleness bound see the same picture as on genuinely mixed hardware.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from types import TracebackType

from medseg.errors import ConfigError

log = logging.getLogger(__name__)


def parse_straggler(spec: str | None) -> tuple[int, float] | None:
    """Parse ``RANK:FACTOR`` (e.g. ``"3:2.0"``) into ``(rank, factor)``; None or blank gives None.

    ``RANK`` is an integer >= 0 and ``FACTOR`` a finite number >= 1 (1 means no slowdown);
    anything else raises :class:`ConfigError`. Whether the rank exists is for the launcher to
    check, since only it knows the world size.
    """
    if spec is None or not str(spec).strip():
        return None
    text = str(spec).strip()
    hint = "expected RANK:FACTOR, e.g. 3:2.0 (rank 3 runs 2x slower)"
    parts = text.split(":")
    if len(parts) != 2:
        raise ConfigError(f"straggler: {text!r}: {hint}")
    rank_s, factor_s = (p.strip() for p in parts)
    try:
        rank = int(rank_s)
    except ValueError:
        raise ConfigError(f"straggler: {text!r}: rank {rank_s!r} is not an integer; {hint}") from None
    try:
        factor = float(factor_s)
    except ValueError:
        raise ConfigError(f"straggler: {text!r}: factor {factor_s!r} is not a number; {hint}") from None
    if rank < 0:
        raise ConfigError(f"straggler: {text!r}: rank must be >= 0, got {rank}")
    if not math.isfinite(factor) or factor < 1.0:
        raise ConfigError(f"straggler: {text!r}: factor must be a finite number >= 1, got {factor_s}")
    return rank, factor


class Straggler:
    """Context manager that stretches the block it wraps by ``factor``, simulating a slower GPU.

    Wrap one training step's compute::

        straggler = Straggler(2.0)
        with straggler:
            loss = step(batch)

    On exit it measures the block's compute time ``t`` and sleeps ``(factor - 1) * t``, so the
    block takes ``factor * t`` in all, as it would on a device with ``1 / factor`` of the speed.
    ``factor == 1.0`` is a no-op. ``slept_s`` accumulates the total injected delay. If the block
    raises, nothing is slept and the exception propagates.

    GPU work is asynchronous: pass ``synchronize`` (e.g. ``torch.cuda.synchronize``) so that the
    measured time covers the kernels and not just their launch; it is called before the timer
    starts and before it stops.
    """

    def __init__(self, factor: float = 1.0, synchronize: Callable[[], object] | None = None) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ConfigError(f"straggler: factor must be a number >= 1, got {factor!r}")
        if not math.isfinite(factor) or factor < 1.0:
            raise ConfigError(f"straggler: factor must be a finite number >= 1, got {factor}")
        self.factor = float(factor)
        self.synchronize = synchronize
        self.slept_s = 0.0
        self._t0: float | None = None

    @classmethod
    def for_rank(
        cls, spec: str | None, rank: int, synchronize: Callable[[], object] | None = None
    ) -> Straggler:
        """The straggler for ``rank`` under ``spec`` (``RANK:FACTOR``): slowed if it is that rank, else a no-op."""
        parsed = parse_straggler(spec)
        factor = parsed[1] if parsed is not None and parsed[0] == rank else 1.0
        if factor != 1.0:
            log.info("straggler: rank %d runs %.2fx slower (simulated)", rank, factor)
        return cls(factor, synchronize)

    @property
    def active(self) -> bool:
        """Whether this straggler slows anything down (``factor > 1``)."""
        return self.factor > 1.0

    def __enter__(self) -> Straggler:
        if self.active:
            if self.synchronize is not None:
                self.synchronize()
            self._t0 = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        t0, self._t0 = self._t0, None
        if not self.active or t0 is None or exc_type is not None:
            return None
        if self.synchronize is not None:
            self.synchronize()
        delay = (self.factor - 1.0) * (time.perf_counter() - t0)
        if delay > 0.0:
            time.sleep(delay)
            self.slept_s += delay
        return None
