"""The ``medseg`` command line.

Every subcommand calls one library function; each command group's options and functions live in its
own module (data, train, plan, bench, sites, app, inference). A :class:`medseg.errors.MedsegError` is
printed as ``error: <message>`` without a traceback and exits with status 2 (as do usage errors).
"""

from __future__ import annotations

import argparse
import logging
import sys

from medseg.cli import app, bench, data, inference, plan, sites, train
from medseg.errors import MedsegError

# Command groups in the order ``medseg --help`` lists them.
COMMAND_GROUPS = (data, train, plan, bench, sites, app, inference)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="medseg", description="MONAI 3D segmentation and classification: data, training, inference."
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add_parser(sub)
    return p


class _OwnMessages(logging.Filter):
    """Keep third-party warnings (MONAI's nvImageCodec notices, deprecations) off the user's terminal.

    medseg's own records and any ERROR pass; the rest are shown with ``-v``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("medseg") or record.levelno >= logging.ERROR


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if not verbose:
        handler.addFilter(_OwnMessages())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.captureWarnings(True)  # warnings.warn from libraries becomes a 'py.warnings' log record
    for noisy in ("monai", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        args.func(args)
    except MedsegError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
