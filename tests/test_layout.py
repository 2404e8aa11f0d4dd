"""The import graph of the product: no cycles, no upward edges between rooms, no private names
imported across modules. Read from the source with ``ast`` (nothing is imported), so it is fast and
sees lazy imports inside functions too.

Rooms, lowest first; a module may import its own room and any room below it, never one above.
docs/architecture.md draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> package name (pyproject.toml's package-dir mapping).
PACKAGES = {
    "medseg": "medseg",
    "datasets": "medseg.datasets",
    "kernels": "medseg.kernels",
    "distributed": "medseg.distributed",
    "apps": "medseg.apps",
}
# (room, rank): a room is a package prefix; the longest matching prefix names a module's room.
ROOMS = {
    "medseg": 0,  # the shared base: errors, config, checkpoint, sysinfo, models
    "medseg.datasets": 1,
    "medseg.kernels": 2,
    "medseg.distributed": 3,  # the engine: session, site_data, sync, comm, launch
    "medseg.distributed.testbed": 4,  # emulation only: the engine never imports it
    "medseg.bundle": 5,
    "medseg.training": 6,
    "medseg.inference": 7,
    "medseg.planning": 8,
    "medseg.bench": 9,
    "medseg.apps": 10,
    "medseg.cli": 11,
    "medseg.__main__": 12,  # `python -m medseg`: the command line
}


def module_files() -> dict[str, Path]:
    """Every product module's dotted name and its file."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "frontend" in parts or (folder == "medseg" and parts[0] in {"datasets", "kernels"}):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for each medseg import in ``path``, lazy ones included."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.startswith("medseg")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("medseg"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, "") if sub in modules else (base, alias.name))
    return found


def room_of(module: str) -> str:
    return max((r for r in ROOMS if module == r or module.startswith(r + ".")), key=len)


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """module -> modules it imports; and the private names imported across modules."""
    files = module_files()
    graph: dict[str, set[str]] = {m: set() for m in files}
    private = []
    for module, path in files.items():
        for target, symbol in imports_of(module, path, set(files)):
            if target not in files:
                continue
            if target != module:
                graph[module].add(target)
            if symbol.startswith("_") and not symbol.startswith("__") and target != module:
                private.append(f"{module} imports {target}.{symbol}")
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Edges into a room of a higher rank, or across two rooms of the same rank."""
    bad = []
    for source, targets in sorted(graph.items()):
        a = room_of(source)
        for target in sorted(targets):
            b = room_of(target)
            if a != b and ROOMS[b] >= ROOMS[a]:
                bad.append(f"{source} ({a}) -> {target} ({b})")
    return bad


def test_no_import_cycles() -> None:
    graph, _ = import_graph()
    assert len(graph) > 60, "the walk found too few modules: is PACKAGES right?"
    assert cycles(graph) == []


def test_no_upward_edges() -> None:
    graph, _ = import_graph()
    assert upward_edges(graph) == []


def test_no_private_names_across_modules() -> None:
    _, private = import_graph()
    assert private == []


@pytest.mark.parametrize(
    "graph, expect",
    [
        ({"medseg.config": {"medseg.training.loop"}, "medseg.training.loop": set()}, "upward"),
        (
            {
                "medseg.inference.io": {"medseg.inference.predict"},
                "medseg.inference.predict": {"medseg.inference.io"},
            },
            "cycle",
        ),
        ({"medseg.distributed.session": {"medseg.distributed.testbed.relay"}}, "upward"),
        ({"medseg.bench.sites": {"medseg.apps.app"}}, "upward"),
        ({"medseg.cli.main": {"medseg.training.loop"}, "medseg.training.loop": {"medseg.config"}}, None),
    ],
)
def test_checker_sees_a_planted_fault(graph: dict[str, set[str]], expect: str | None) -> None:
    """The checks themselves can fail: a planted upward edge or cycle is reported, a clean graph is not."""
    assert bool(upward_edges(graph)) == (expect == "upward")
    assert bool(cycles(graph)) == (expect == "cycle")
