"""Stage marks of the page's first paint, for the viewer benchmark (``scripts/bench_viewer.py``)."""

from __future__ import annotations

import json
import os
import time


def mark(stage: str) -> None:
    """Append ``{"stage", "t"}`` (wall clock) to the file named by ``MEDSEG_APP_TIMINGS``, if set:
    the viewer benchmark's breakdown of a first paint. Off by default."""
    path = os.environ.get("MEDSEG_APP_TIMINGS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"stage": stage, "t": time.time()}) + "\n")
