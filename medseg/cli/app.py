"""``medseg app``: the Streamlit viewer on localhost."""

from __future__ import annotations

import argparse
from pathlib import Path


def _app(args: argparse.Namespace) -> None:
    from medseg.apps.launch import serve

    serve(args.runs or [Path("runs")], args.port, args.address)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``medseg app``."""
    s = subparsers.add_parser("app", help="start the Streamlit viewer on localhost")
    s.add_argument(
        "--runs",
        type=Path,
        action="append",
        help="folder of runs to list models from (default runs; repeatable)",
    )
    s.add_argument("--port", type=int, default=8501, help="port to listen on (default 8501)")
    s.add_argument(
        "--address",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; the page has no login, so "
        "bind another only behind a reverse proxy with the hospital's login and TLS, see README)",
    )
    s.set_defaults(func=_app)
