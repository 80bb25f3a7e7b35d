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
    # cli_checks: `samebits serve`'s option types; weights: the vLLM transfer's buffer default
    "serve": {"engine", "model", "requests", "cli_checks", "weights"},
    "rl": {"client", "engine", "model", "numerics", "requests", "trainer", "plotting"},
    "verify": {"engine", "model", "numerics", "requests", "trainer"},
    "integrations": {"client", "engine", "numerics", "requests", "trainer"},  # frameworks' adapters (TRL)
    "bench": {"engine", "model", "numerics", "requests", "trainer", "plotting"},
    "cli_checks": {"engine", "model", "requests"},
    "cli": {"bench", "cli_checks", "requests", "rl", "serve", "verify"},  # requests: the formula names
}


def _imports(path: Path) -> set[str]:
    """The top-level samebits packages that `path` imports (the package __init__ aside)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "samebits":
            names = [f"samebits.{a.name}" for a in node.names if _is_module(a.name)]  # from samebits import x
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "samebits" and len(parts) > 1:
                out.add(parts[1])
    return out


def _is_module(name: str) -> bool:
    return (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()


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
    f.write_text(
        "from samebits.engine.llm import LLM\n"
        "import samebits.numerics.ops\n"
        "from samebits import __version__, trainer\n"
    )
    assert _imports(f) == {"engine", "numerics", "trainer"}


# --- circles between modules, inside a package too (function-level imports count) -----------


def _module_name(path: Path, root: Path) -> str:
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _module_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the tree at `root` it imports, anywhere in its body. `from pkg
    import sub` counts as an import of pkg.sub when sub is a module, else of pkg (its __init__)."""
    files = {_module_name(f, root): f for f in root.rglob("*.py")}
    graph = {}
    for name, f in files.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    out.add(sub if sub in files else node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in files and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle as a path that comes back to its start (one a strongly connected set)."""
    found, done = [], set()

    def visit(node, stack):
        if node in stack:
            found.append([*stack[stack.index(node) :], node])
            return
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*stack, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_module_imports_one_that_imports_it_back():
    circles = _circles(_module_graph(ROOT))
    assert not circles, f"import circles: {[' -> '.join(c) for c in circles]}"


def test_a_planted_circle_inside_a_package_is_caught(tmp_path):
    # negative control: a lazy (function-level) import back, which a module-level scan would miss
    pkg = tmp_path / "samebits" / "trainer"
    pkg.mkdir(parents=True)
    (tmp_path / "samebits" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from samebits.trainer.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from samebits.trainer.b import g\n    return g()\n")
    (pkg / "b.py").write_text("from samebits.trainer import a\n\ndef g():\n    return a\n")
    graph = _module_graph(tmp_path / "samebits")
    assert graph["samebits.trainer.b"] == {"samebits.trainer.a"}  # the submodule, not the package
    assert _circles(graph) == [["samebits.trainer.a", "samebits.trainer.b", "samebits.trainer.a"]]
