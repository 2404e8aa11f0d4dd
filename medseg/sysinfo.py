"""What this machine gives medseg: the one place that reads how much memory is left.

:func:`available_memory` is what every memory check uses (reading an image, planning a network,
predicting a volume): MemAvailable from ``/proc/meminfo``, capped by the cgroup's limit less its
usage (v2 ``memory.max``/``memory.current`` or v1 ``memory.limit_in_bytes``/``usage_in_bytes``),
and by ``MEDSEG_MAX_IMAGE_MB`` when a user or test sets it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

UNKNOWN = 2**62  # what "no limit found" counts as
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return UNKNOWN


def available_memory() -> int:
    """Bytes this process can still allocate: MemAvailable, capped by a cgroup limit and MEDSEG_MAX_IMAGE_MB."""
    avail = _mem_available()
    for limit_file, usage_file in CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and limit < 2**60 and usage is not None:
            avail = min(avail, max(limit - usage, 0))
    env = os.environ.get("MEDSEG_MAX_IMAGE_MB")
    if env:
        try:
            avail = min(avail, int(float(env) * 2**20))
        except ValueError:
            log.warning("MEDSEG_MAX_IMAGE_MB=%r is not a number; ignored", env)
    return int(avail)
