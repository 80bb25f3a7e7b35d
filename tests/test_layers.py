"""The import graph holds: each package imports only the layers below it (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import samebits

ROOT = Path(samebits.__file__).parent

# package -> the samebits packages it may import (the picture in docs/design.md)
ALLOWED = {
    "requests": set(),
    "kernels": set(),
    "progress": set(),
    "plotting": set(),
    "numerics": {"kernels", "requests"},  # requests: the formula names
    "model": {"kernels", "numerics", "requests", "progress"},
    "trainer": {"kernels", "numerics", "model", "requests"},
    "weights": set(),  # process group, IPC serialization, the receiver (duck-typed over LLM)
    "engine": {"numerics", "model", "requests", "progress", "weights"},  # progress: update_weights_from_disk
    "client": {"engine", "weights"},  # the trainer's side of weight sync
    "serve": {"engine", "model", "requests"},
    "rl": {"client", "engine", "model", "numerics", "requests", "trainer", "plotting"},
    "verify": {"engine", "model", "numerics", "requests", "trainer"},
    "integrations": {"client", "engine", "numerics", "requests", "trainer"},  # frameworks' adapters (TRL)
    "bench": {"engine", "model", "numerics", "requests", "trainer", "plotting"},
    "cli_checks": {"engine", "model", "requests"},
    "cli": {"bench", "cli_checks", "rl", "serve", "verify"},
}


def _imports(path: Path) -> set[str]:
    """The top-level samebits packages that `path` imports (the package __init__ aside)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "samebits" and len(parts) > 1:
                out.add(parts[1])
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        if rel.name == "__init__.py" and len(rel.parts) == 1:
            continue  # samebits/__init__.py: the lazy public names
        pkg = rel.parts[0].removesuffix(".py")
        graph.setdefault(pkg, set()).update(_imports(f) - {pkg})
    return graph


def test_every_package_imports_only_the_layers_below_it():
    graph = _graph()
    assert set(graph) <= set(ALLOWED), f"new packages need a place in ALLOWED: {set(graph) - set(ALLOWED)}"
    bad = {pkg: sorted(deps - ALLOWED[pkg]) for pkg, deps in graph.items() if deps - ALLOWED[pkg]}
    assert not bad, f"imports from a layer above (or beside): {bad}"


def test_the_allowed_graph_has_no_cycle():
    # control for the test above: ALLOWED itself must be a layering (a DAG)
    done = set()

    def visit(pkg, stack):
        assert pkg not in stack, f"cycle: {' -> '.join([*stack, pkg])}"
        if pkg in done:
            return
        for dep in ALLOWED[pkg]:
            visit(dep, [*stack, pkg])
        done.add(pkg)

    for pkg in ALLOWED:
        visit(pkg, [])


def test_a_file_importing_upward_is_caught(tmp_path):
    # negative control: the scan sees an upward import in a kernels-like file
    f = tmp_path / "x.py"
    f.write_text("from samebits.engine.llm import LLM\nimport samebits.numerics.ops\n")
    assert _imports(f) == {"engine", "numerics"}
