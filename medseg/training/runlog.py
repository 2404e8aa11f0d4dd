"""A run folder's record of progress: ``metrics.jsonl`` (one JSON object per epoch) and its plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_metrics(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Rewrite the whole file under a temporary name, then rename: never a torn last line."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def plot_learning_curve(records: list[dict[str, Any]], key_metric: str, path: str | Path) -> None:
    """Training loss and the key validation metric against epoch, as a PNG.

    A site-local run (records with ``sites``) gets one line of the key metric per site, dashed, beside
    the pooled one. matplotlib is imported here, not with the module: ranks other than 0 never plot
    and do not import it (``medseg.distributed.launch.launcher.UNUSED_IN_OTHER_RANKS``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    epochs = [r["epoch"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(epochs, [r["train_loss"] for r in records], "o-", color="tab:blue", label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("train loss", color="tab:blue")
    val = [(r["epoch"], r[key_metric]) for r in records if r.get(key_metric) is not None]
    if val:
        ax2 = ax.twinx()
        ax2.plot(
            *zip(*val),
            "s-",
            color="tab:orange",
            label=f"{key_metric} (pooled)" if "sites" in records[-1] else key_metric,
        )
        sites = sorted({s for r in records for s in (r.get("sites") or {})})
        for i, site in enumerate(sites):
            pts = [
                (r["epoch"], r["sites"][site][key_metric])
                for r in records
                if (r.get("sites") or {}).get(site, {}).get(key_metric) is not None
            ]
            if pts:
                ax2.plot(*zip(*pts), "--", marker=".", color=f"C{(i + 2) % 10}", label=f"site {site}")
        if sites:
            ax2.legend(loc="lower right", fontsize=7)
        ax2.set_ylabel(key_metric, color="tab:orange")
        ax2.set_ylim(0, 1)
    ax.set_title(path.parent.name)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
