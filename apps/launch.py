"""``medseg app``: start Streamlit on localhost serving the viewer page."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from medseg.apps.upload import max_upload_mb
from medseg.errors import MedsegError

log = logging.getLogger(__name__)

APP_PAGE = Path(__file__).with_name("app.py")


def streamlit_command(port: int, address: str = "localhost") -> list[str]:
    """The ``streamlit run`` command line: local address only, no usage statistics, no browser."""
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


def serve(runs: Sequence[str | Path], port: int) -> None:
    """Run the viewer until interrupted; a Streamlit failure (port taken, ...) is a MedsegError."""
    missing = [str(r) for r in runs if not Path(r).is_dir()]
    if missing:
        raise MedsegError(
            f"{', '.join(missing)}: no such folder; give --runs a folder that holds run folders"
        )
    log.info("viewer on http://localhost:%d (models from %s)", port, ", ".join(str(r) for r in runs))
    code = subprocess.call(streamlit_command(port), env=app_env(runs))
    if code not in (0, -2, 130):  # -2/130: stopped with Ctrl-C
        raise MedsegError(f"streamlit stopped with status {code} (is port {port} already in use? try --port)")
