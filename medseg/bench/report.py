"""Writing benchmark results: JSON written atomically, and one tagged section of docs/benchmarks.md.

Each benchmark owns the part of the markdown file between ``<!-- bench:TAG -->`` and
``<!-- /bench:TAG -->`` and rewrites only that, so the benchmarks can be re-run independently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON, written atomically (a temporary file renamed over ``path``)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def replace_section(markdown: Path, tag: str, body: str) -> None:
    """Put ``body`` between the ``bench:tag`` markers of ``markdown`` (appended when absent)."""
    start_mark, end_mark = f"<!-- bench:{tag} -->", f"<!-- /bench:{tag} -->"
    section = f"{start_mark}\n{body.strip()}\n{end_mark}"
    text = markdown.read_text() if markdown.exists() else "# Benchmarks\n"
    start, end = text.find(start_mark), text.find(end_mark)
    if start >= 0 and end > start:
        text = text[:start] + section + text[end + len(end_mark) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    tmp = markdown.with_name(f".{markdown.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, markdown)
