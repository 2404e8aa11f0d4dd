"""``medseg app``: start Streamlit serving the viewer page, on 127.0.0.1 unless told otherwise.

The page has no login of its own: it binds the loopback address by default, so only this machine
reaches it. ``--address`` binds another (``0.0.0.0`` for every interface), for a reverse proxy
that adds the hospital's login and TLS in front of it (README, "Viewer"). Streamlit's XSRF
protection and CORS check are switched on explicitly, whatever a local ``config.toml`` says.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from medseg.apps.limits import max_upload_mb
from medseg.errors import MedsegError

log = logging.getLogger(__name__)

APP_PAGE = Path(__file__).with_name("app.py")
STOP_GRACE_S = 10.0  # after SIGTERM/SIGINT, how long the Streamlit server may take before it is killed
DEFAULT_ADDRESS = "127.0.0.1"  # loopback only: the page has no login of its own
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def streamlit_command(port: int, address: str = DEFAULT_ADDRESS) -> list[str]:
    """The ``streamlit run`` command line: the loopback address unless told otherwise, the upload
    limit, XSRF protection and CORS on, no usage statistics, no browser."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_PAGE),
        "--server.address",
        address,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--server.maxUploadSize",
        str(max_upload_mb()),
        "--server.enableXsrfProtection",
        "true",
        "--server.enableCORS",
        "true",
        "--server.fileWatcherType",
        "none",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "minimal",
        "--global.developmentMode",
        "false",
    ]


def app_env(runs: Sequence[str | Path]) -> dict[str, str]:
    """The environment the page reads its model folders from (absolute, so the page's cwd does not matter)."""
    env = dict(os.environ)
    env["MEDSEG_APP_RUNS"] = os.pathsep.join(str(Path(r).expanduser().resolve()) for r in runs)
    return env


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when its parent dies (PR_SET_PDEATHSIG).

    Signal forwarding covers SIGTERM and SIGINT; this covers a parent killed with SIGKILL.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: forwarding still applies
        pass


def serve(runs: Sequence[str | Path], port: int, address: str = DEFAULT_ADDRESS) -> None:
    """Run the viewer until interrupted; a Streamlit failure (port taken, ...) is a MedsegError.

    SIGTERM and SIGINT sent to ``medseg app`` are passed on to the Streamlit server, which is then
    waited for (and killed after ``STOP_GRACE_S``), so stopping the command stops the server (no
    orphan keeps the port).
    """
    missing = [str(r) for r in runs if not Path(r).is_dir()]
    if missing:
        raise MedsegError(
            f"{', '.join(missing)}: no such folder; give --runs a folder that holds run folders"
        )
    host = f"[{address}]" if ":" in address else address
    log.info("viewer on http://%s:%d (models from %s)", host, port, ", ".join(str(r) for r in runs))
    if address not in LOOPBACK:
        log.warning(
            "the viewer listens on %s, not only on this machine, and has no login of its own: put it "
            "behind a reverse proxy with the hospital's login and TLS (README, Viewer)",
            address,
        )
    proc = subprocess.Popen(streamlit_command(port, address), env=app_env(runs), preexec_fn=_die_with_parent)
    stopping: list[float] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(time.monotonic())
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                # a server busy in a model run may not stop at once: kill it after STOP_GRACE_S
                if stopping and time.monotonic() - stopping[0] > STOP_GRACE_S:
                    proc.kill()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping:
        return
    if code not in (0, -2, -15, 130, 143):  # stopped with Ctrl-C or SIGTERM
        raise MedsegError(f"streamlit stopped with status {code} (is port {port} already in use? try --port)")
