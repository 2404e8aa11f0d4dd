"""Error messages for a person in a browser.

medseg's library messages are written for the command line: they name files by their full path and
suggest flags (``--resample``, ``--series``) or commands (``medseg data validate``). In the viewer
the path is a temporary folder the user never saw and there is no command line, so
:func:`for_browser` rewrites a message: known command-line advice becomes what to do in the page,
remaining paths shrink to the file's name, and leftover command mentions are dropped.
"""

from __future__ import annotations

import logging
import re

from medseg.errors import MedsegError

log = logging.getLogger(__name__)

# (pattern, replacement): command-line advice in library messages -> advice for the page
_ADVICE: tuple[tuple[str, str], ...] = (
    (
        r"This reader will not silently average the spacing \(unlike MONAI's PydicomReader\); "
        r"pass resample=True \(CLI --resample\) to interpolate onto a regular grid, or supply the complete series",
        "The viewer does not fill in missing slices; upload the complete series",
    ),
    (
        r"pass resample=True \(CLI --resample\) to interpolate onto a regular grid, or supply the complete series",
        "upload the complete series",
    ),
    (r"; choose one with --series UID \(series_uid=\.\.\.\)", "; choose one in the list"),
    (r",? ?so --resample will not interpolate it", ""),
    (
        r" ?If you made this bundle yourself and trust it, pass --trust-bundle \(load_bundle\(\.\.\., trust=True\)\)\.",
        " The viewer does not open such bundles.",
    ),
    (r"[;,]? ?(?:run|check it with) `medseg [^`]*`", ""),
    (r"[;,]? ?(?:make|convert) (?:one|them first) with `medseg [^`]*`[^;.]*", ""),
    (r"\s*\((?:CLI )?--[a-z-]+[^)]*\)", ""),
)
# an absolute path, or one inside the upload's temporary folder ("upload/..."): keep its last part
_PATH = re.compile(r"(?<![\w.])(?:upload)?(?:/[\w.+@%-]+)+/?")


def for_browser(message: str) -> str:
    """``message`` without folder paths and command-line advice (see the module docstring)."""
    text = message
    for pattern, repl in _ADVICE:
        text = re.sub(pattern, repl, text)
    text = _PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1] or "the file", text)
    text = re.sub(r"`?medseg (?:data|infer|train|evaluate|app)[^`;.\n]*`?", "", text)
    text = re.sub(r"\s+([;,.])", r"\1", text)
    return re.sub(r"[ \t]{2,}", " ", text).strip()


def problem(e: BaseException) -> str:
    """A message for the page: medseg's own (rewritten for a browser user), or a plain sentence for
    anything unexpected (logged with its traceback for whoever runs the server; never shown)."""
    if isinstance(e, MedsegError):
        return for_browser(str(e))
    log.exception("unexpected error in the viewer")
    detail = for_browser(str(e)).strip("'\" ")
    detail = f" ({detail})" if detail and len(detail) < 200 else ""
    return (
        f"The viewer could not finish this step{detail}. The server's log has the details; "
        "the page keeps working with other inputs."
    )
