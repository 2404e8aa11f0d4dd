"""The protocol every ``medseg bench`` command follows: measure, judge, tabulate, plot, report.

A benchmark run produces one JSON-able result document. A :class:`Benchmark` names the functions
that turn that document into

- its targets: :class:`Target`, what the run had to achieve and whether it did;
- a markdown table (:func:`table_head` and :func:`table_row` write the rows);
- a plot (drawn inside :func:`figure`);

and :meth:`Benchmark.write_report` publishes them: the document as JSON and, with a markdown file,
the benchmark's tagged section of it (intro, table, one ``met``/``MISSED`` line per target, the
plot) beside ``bench-TAG.png``.

Measurements whose peak memory is reported run each in a fresh process (:func:`run_isolated`):
a fresh allocator is the only honest peak (docs/design.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from medseg.bench.report import replace_section, write_json

Result = dict[str, Any]

#: Every buffer above 64 KiB is its own mapping, returned to the OS when freed, so that a child's
#: VmHWM is the peak of what it used, not of what the allocator kept (docs/design.md).
HONEST_PEAK_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


class Target(NamedTuple):
    """One target a run is judged on: what it requires (with the measured figure) and whether it was met."""

    name: str
    met: bool


def at_most(name: str, value: float | None, limit: float) -> Target:
    """The target ``value <= limit``; a figure that was not measured (None) misses it."""
    return Target(name, value is not None and value <= limit)


def within(name: str, value: float | None, width: float) -> Target:
    """The two-sided target ``|value| <= width``; a figure that was not measured (None) misses it."""
    return Target(name, value is not None and abs(value) <= width)


def at_least(name: str, value: float | None, limit: float) -> Target:
    """The target ``value >= limit``; a figure that was not measured (None) misses it."""
    return Target(name, value is not None and value >= limit)


def target_lines(targets: list[Target]) -> str:
    """The targets as a markdown list: ``- met: name`` or ``- MISSED: name``."""
    return "\n".join(f"- {'met' if t.met else 'MISSED'}: {t.name}" for t in targets)


def table_row(*cells: object) -> str:
    """One markdown table row; an empty cell is written ``| |``."""
    return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"


def table_head(columns: list[str], align: str) -> list[str]:
    """A markdown table's header and alignment rows; ``align`` has a letter a column: ``l`` or ``r``."""
    return [table_row(*columns), "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]


@contextmanager
def figure(
    path: Path,
    figsize: tuple[float, float],
    ncols: int = 1,
    squeeze: bool = True,
    dpi: float | None = None,
    save_dpi: float | None = None,
) -> Iterator[Any]:
    """Yield ``(figure, axes)``: one row of ``ncols`` axes, laid out tight and saved to ``path``
    when the block ends. ``dpi`` is the figure's, ``save_dpi`` the file's (None: the figure's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize, dpi=dpi, squeeze=squeeze)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=save_dpi)
    finally:
        plt.close(fig)


def run_isolated(cmd: list[str], timeout_s: float, error_chars: int = 300) -> Result:
    """Run one measurement in a fresh process (:data:`HONEST_PEAK_ENV` set) and return its result.

    The child prints its result as JSON on its last stdout line; ``wall_s`` (launch to exit) is
    added. A child that times out or fails gives ``{"error": ...}`` with its last stderr line.
    """
    env = {**os.environ, **HONEST_PEAK_ENV}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {last[:error_chars]}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


@dataclass(frozen=True)
class Benchmark:
    """One benchmark's part of the protocol: functions of its result document.

    ``tag`` names its section of the markdown file (``<!-- bench:TAG -->``) and its plot
    (``bench-TAG.png``); with ``full_tag``, a run that is not ``quick`` writes that section instead,
    so the quick and the full run of a benchmark are kept side by side.
    """

    tag: str
    intro: Callable[[Result], str]
    targets: Callable[[Result], list[Target]]
    table: Callable[[Result], str]
    plot: Callable[[Result, Path], None]
    full_tag: str | None = None

    def section_tag(self, result: Result) -> str:
        return self.full_tag if self.full_tag and not result.get("quick") else self.tag

    def write_report(self, result: Result, json_out: Path, markdown: Path | None) -> None:
        """Write ``result`` as JSON and, with ``markdown``, this benchmark's section and plot."""
        write_json(json_out, result)
        if markdown is None:
            return
        tag = self.section_tag(result)
        png = markdown.parent / f"bench-{tag}.png"
        self.plot(result, png)
        body = [self.intro(result), self.table(result), target_lines(self.targets(result))]
        replace_section(markdown, tag, "\n\n".join([*body, f"![{tag} results]({png.name})"]))
