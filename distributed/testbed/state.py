"""The testbed's state file and the machine-wide lock around every ``up`` and ``down``.

``/run/medseg-sites/state.json`` holds the sites, the WAN, the owner and the process ids, so that
``medseg sites up`` in one process and ``Testbed.current()`` in another see the same testbed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator

from medseg.distributed.testbed.spec import STATE_DIR, SitesError

STATE_FILE = STATE_DIR / "state.json"


@contextlib.contextmanager
def lock(timeout: float = 120.0) -> Iterator[None]:
    """Serialise every up/down on this machine (two testbeds would fight over names and routes)."""
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / "lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        end = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise SitesError(
                        f"another process holds {STATE_DIR / 'lock'} (a testbed going up or down) for over {timeout:g} s"
                    ) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def read_state() -> dict | None:
    """The state of the testbed on this machine, or None when there is none (or it is unreadable)."""
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None


def write_state(state: dict) -> None:
    """Replace the state file at once (written to a temporary name, then renamed)."""
    tmp = STATE_DIR / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, STATE_FILE)
