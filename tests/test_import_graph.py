"""The package's imports point down: no module imports itself through others (no cycle), the
ground floor imports nothing above it, and only the top floor imports the top floor.

The graph is read from the source with ``ast``, not by importing: every ``import`` and
``from ... import`` statement of every module counts, at module level or inside a function, a
class or an ``if TYPE_CHECKING`` block. ``from X import Y`` is an arrow to the module ``X.Y``
when there is one, else to ``X``; parent packages, which Python imports before any submodule,
are not arrows of their own (a package's ``__init__`` importing its submodules would otherwise
be a cycle with every one of them).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "moebalance"

# STYLE.md's layout: the ground floor imports nothing above it ...
GROUND_FLOOR = {f"{PACKAGE}.{name}" for name in (
    "_arrays", "topology", "measure", "backends", "tracker", "placement", "metrics", "workloads",
    "collective_errors")}
# ... and the top floor is imported by nothing below it but the package's public face
# (moebalance/__init__.py exports warm_up) and ``python -m moebalance``.
TOP_FLOOR_MODULES = {f"{PACKAGE}.{name}" for name in ("warmup", "cli", "cli_args", "__main__")}
# The simulator is a tool like the benchmarks: it runs the planner, EPLB's method and the
# command-line helpers, and nothing below imports it.
TOP_FLOOR_PACKAGES = (f"{PACKAGE}.benchmarks", f"{PACKAGE}.simulation")
FACES = {PACKAGE, f"{PACKAGE}.__main__"}


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of ``package`` under ``root``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _base(module: str, path: Path, level: int) -> str:
    """The package a relative import of ``level`` dots in ``module`` starts from."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return package


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (see the module docstring for the rules)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    # ``import a.b.c`` binds a, imports a.b.c: the deepest module of ours it names
                    parts = alias.name.split(".")
                    prefixes = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
                    targets += [next((p for p in prefixes if p in modules), None)]
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = _base(module, path, node.level)
                    source = f"{base}.{source}" if source else base
                for alias in node.names:
                    child = f"{source}.{alias.name}"
                    targets.append(child if child in modules else source)
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when it has none."""
    state: dict[str, int] = {}  # absent: unvisited, 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def _is_top_floor(module: str) -> bool:
    return module in TOP_FLOOR_MODULES or any(
        module == p or module.startswith(p + ".") for p in TOP_FLOOR_PACKAGES)


GRAPH = import_graph(module_files())


def test_graph_resolves_relative_and_function_level_imports():
    # module level, one dot; inside a function, two dots; ``from .. import name`` of a module
    assert "moebalance.cli_args" in GRAPH["moebalance.cli"]
    assert "moebalance.benchmarks.planner" in GRAPH["moebalance.cli"]
    assert "moebalance.workloads" in GRAPH["moebalance.benchmarks.planner"]
    assert "moebalance.planner.eplb" in GRAPH["moebalance.planner"]
    # ``from .. import __version__`` is not a module: the arrow goes to the package itself
    assert "moebalance" in GRAPH["moebalance.benchmarks.report"]


def test_find_cycle_reports_the_loop_it_finds():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_package_imports_have_no_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_ground_floor_imports_only_the_ground_floor():
    assert GROUND_FLOOR <= set(GRAPH), sorted(GROUND_FLOOR - set(GRAPH))
    upward = {m: sorted(GRAPH[m] - GROUND_FLOOR) for m in sorted(GROUND_FLOOR) if GRAPH[m] - GROUND_FLOOR}
    assert not upward, f"ground-floor modules import from above: {upward}"


def test_only_the_top_floor_imports_the_top_floor():
    upward = {m: sorted(t for t in GRAPH[m] if _is_top_floor(t)) for m in sorted(GRAPH)
              if not _is_top_floor(m) and m not in FACES}
    upward = {m: ts for m, ts in upward.items() if ts}
    assert not upward, f"modules below the top floor import it: {upward}"
