"""Each rank's synchronisation state (error-feedback residuals, optimizer moments), kept on its own host.

A rank writes ``optimizer.sync_state()`` to ``<run>/checkpoints/sync/<shard>-e<epoch>.pt`` at the end
of every epoch, atomically, and keeps the two previous epochs' files too. The chief's checkpoint
holds a marker, ``{"epoch": e, "ranks": n}``, that says which epoch's files a resumed run loads, and
a chief that dies before it writes epoch e's checkpoint leaves epoch e - 1's marker. With sites no
barrier separates the epochs, so a rank can already end epoch e + 1 (a FedAvg epoch without a round
trains inside its site) while the chief writes epoch e's checkpoint; the epoch-end message of e + 1
waits for the chief, so no rank gets further ahead, and e - 1's file is still there. Nothing crosses
the network: residuals are as large as the model, and each rank needs only its own.

A rank's *shard* name is ``r<rank>``, or with sites ``<site>-<i>`` (its index among its site's
ranks), so that a restart with fewer sites finds each remaining site's state by its name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from medseg.checkpoint import load_checkpoint, save_checkpoint

log = logging.getLogger(__name__)


def shard_name(rank: int, site: str | None, rank_sites: list[str]) -> str:
    """``r<rank>``, or ``<site>-<i>`` with ``i`` the rank's index among its site's ranks."""
    if site is None:
        return f"r{rank}"
    mine = [r for r, s in enumerate(rank_sites) if s == site]
    return f"{site}-{mine.index(rank)}"


def save(state: dict[str, Any], run_dir: Path, epoch: int, rank: int, shard: str) -> None:
    """Write ``state`` as ``shard``'s file of ``epoch``; delete its files older than ``epoch - 2``."""
    folder = run_dir / "checkpoints" / "sync"
    save_checkpoint({"epoch": epoch, "rank": rank, "state": state}, folder / f"{shard}-e{epoch}.pt")
    for old in folder.glob(f"{shard}-e*.pt"):
        if int(old.stem.rsplit("-e", 1)[1]) < epoch - 2:
            old.unlink(missing_ok=True)


def load(
    run_dir: Path, shard: str, marker: dict[str, int], rank: int, size: int, by_site: bool
) -> dict[str, Any] | None:
    """``shard``'s state of the marker's epoch; None (warned) when it is missing or was made for
    another number of ranks (``by_site``: found by site name, so the number of ranks may differ)."""
    path = run_dir / "checkpoints" / "sync" / f"{shard}-e{marker['epoch']}.pt"
    if (not by_site and marker.get("ranks") != size) or not path.is_file():
        log.warning(
            "rank %d: no synchronisation state of epoch %d for %d ranks at %s (checkpoint made by %s ranks): "
            "residuals and moments restart",
            rank,
            marker["epoch"],
            size,
            path,
            marker.get("ranks"),
        )
        return None
    return load_checkpoint(path)["state"]
