"""The numbers of one distributed epoch: what each rank measured, and the job's summary of them.

Every rank builds :func:`rank_numbers` at the end of an epoch; rank 0 gathers them all and
:func:`job_numbers` turns them into the ``dist_*`` keys of the epoch's metrics record.
"""

from __future__ import annotations

import resource
from typing import Any

from medseg.distributed.sync.common import StepStats


def rank_numbers(
    stats: StepStats, samples: int, setup_wan_bytes: int, wall_s: float, slept_s: float, compute_s: float
) -> dict[str, Any]:
    """This rank's epoch: samples, steps, bytes sent (set-up transfers counted in the WAN bytes),
    time in in-site averaging and waiting on other sites, wall and compute time, peak memory."""
    return {
        "samples": samples,
        "steps": stats.steps,
        "bytes": stats.bytes_sent,
        "wan_bytes": stats.wan_bytes + setup_wan_bytes,
        "site_s": stats.site_s,
        "wan_wait_s": stats.wan_wait_s,
        "max_staleness": max(stats.staleness, default=0),
        "wall_s": wall_s,
        "slept_s": slept_s,
        "compute_s": compute_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def job_numbers(
    everyone: list[dict[str, Any]],
    groups: list[list[int]],
    periods: list[int],
    wan_factor: int,
    exchange_s: float | None,
) -> dict[str, Any]:
    """The job's epoch from every rank's :func:`rank_numbers`, with the round plan it ran under.

    The epoch lasts as long as its slowest rank; bytes per step are the ranks' mean, WAN bytes
    their sum. Per rank: compute (forward, backward, emulated slowness), in-site averaging,
    waiting on other sites and wall time; peak memory; samples per second of compute.
    """
    slowest = max(r["wall_s"] for r in everyone)
    return {
        "dist_samples_per_s": sum(r["samples"] for r in everyone) / slowest,
        "dist_epoch_s": slowest,
        "dist_bytes_per_step": sum(r["bytes"] / max(r["steps"], 1) for r in everyone) / len(everyone),
        "dist_wan_bytes": sum(r["wan_bytes"] for r in everyone),
        "dist_max_staleness": max(r["max_staleness"] for r in everyone),
        "dist_wait_s": max(r["wan_wait_s"] for r in everyone),
        "dist_groups": groups,
        "dist_periods": periods,
        "dist_wan_factor": wan_factor,
        "dist_exchange_s": exchange_s,
        "dist_rank_time": [
            {k: round(r[k], 3) for k in ("compute_s", "site_s", "wan_wait_s", "wall_s")} for r in everyone
        ],
        "dist_rank_peak_rss_mb": [round(r["peak_rss_mb"]) for r in everyone],
        "dist_rank_speeds": [
            round(r["samples"] / r["compute_s"], 3) if r["compute_s"] else None for r in everyone
        ],
    }
