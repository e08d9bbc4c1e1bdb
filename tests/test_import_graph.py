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
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "moebalance"

# STYLE.md's layout: the ground floor imports nothing above it ...
GROUND_FLOOR = {f"{PACKAGE}.{name}" for name in (
    "_check", "topology", "measure", "backends", "tracker", "placement", "metrics",
    "collective_errors", "device_index")}
# ... and the library's top floor is imported by nothing below it but the package's public face
# (moebalance/__init__.py exports warm_up).
TOP_FLOOR_MODULES = {f"{PACKAGE}.warmup"}
# The tools: the command and the lab (benchmarks, simulator, workloads, models). No library
# module imports them; the lab reaches the command only through its argument helpers.
TOOLS = (f"{PACKAGE}.cli", f"{PACKAGE}.lab", f"{PACKAGE}.__main__")
TOOLS_GROUND = f"{PACKAGE}.cli.args"
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


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _is_top_floor(module: str) -> bool:
    return module in TOP_FLOOR_MODULES or _within(module, TOOLS)


def room(module: str) -> str:
    """The room a module lives in: its sub-package (``moebalance.lab.sim``), or the module itself
    for the files of the package's own folder and for the tools' argument helpers."""
    if module == TOOLS_GROUND or module.count(".") == 1:
        return module
    return module.rpartition(".")[0] if module not in PACKAGES else module


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Room -> the rooms its modules import (the package's face left out: it imports them all)."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module in FACES:
            continue
        rooms.setdefault(room(module), set()).update(
            room(t) for t in targets if t not in FACES and room(t) != room(module))
    return rooms


MODULES = module_files()
PACKAGES = {m for m, path in MODULES.items() if path.name == "__init__.py"}
GRAPH = import_graph(MODULES)


def test_graph_resolves_relative_and_function_level_imports():
    # module level, one dot; inside a function, two dots; ``from .. import name`` of a module
    assert "moebalance.cli.args" in GRAPH["moebalance.cli.main"]
    assert "moebalance.lab.bench.planner" in GRAPH["moebalance.cli.main"]
    assert "moebalance.lab.workloads" in GRAPH["moebalance.lab.bench.planner"]
    assert "moebalance.planner.eplb" in GRAPH["moebalance.planner"]
    # ``from .. import __version__`` is not a module: the arrow goes to the package itself
    assert "moebalance" in GRAPH["moebalance.lab.report"]


def test_find_cycle_reports_the_loop_it_finds():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_package_imports_have_no_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_ground_floor_imports_only_the_ground_floor():
    assert GROUND_FLOOR <= set(GRAPH), sorted(GROUND_FLOOR - set(GRAPH))
    upward = {m: sorted(GRAPH[m] - GROUND_FLOOR) for m in sorted(GROUND_FLOOR)
              if GRAPH[m] - GROUND_FLOOR}
    assert not upward, f"ground-floor modules import from above: {upward}"


def test_only_the_top_floor_imports_the_top_floor():
    upward = {m: sorted(t for t in GRAPH[m] if _is_top_floor(t)) for m in sorted(GRAPH)
              if not _is_top_floor(m) and m not in FACES}
    upward = {m: ts for m, ts in upward.items() if ts}
    assert not upward, f"modules below the top floor import it: {upward}"


def test_rooms_have_no_cycle():
    # Files may keep clear of cycles while their folders do not (the simulator taking a helper of
    # the benchmarks while a benchmark runs the simulator): the folders are checked as a whole.
    cycle = find_cycle(room_graph(GRAPH))
    assert cycle is None, "cycle between folders: " + " -> ".join(cycle)


def test_no_library_module_imports_the_tools():
    library = [m for m in GRAPH if not _within(m, TOOLS) and m not in FACES]
    reaching = {m: sorted(t for t in GRAPH[m] if _within(t, TOOLS)) for m in library}
    reaching = {m: ts for m, ts in reaching.items() if ts}
    assert not reaching, f"library modules import the tools (cli, lab): {reaching}"


def test_the_lab_reaches_the_command_only_through_its_argument_helpers():
    lab = [m for m in GRAPH if _within(m, (f"{PACKAGE}.lab",))]
    reaching = {m: sorted(t for t in GRAPH[m] if _within(t, (f"{PACKAGE}.cli",))
                          and t != TOOLS_GROUND)
                for m in lab}
    reaching = {m: ts for m, ts in reaching.items() if ts}
    assert not reaching, f"lab modules import the command: {reaching}"
    assert not GRAPH[TOOLS_GROUND] & {m for m in GRAPH if _within(m, (f"{PACKAGE}.lab",))}


def test_importing_the_package_leaves_the_heavy_optional_modules_unloaded():
    """``import moebalance`` costs every rank of a job and every command its time: torch's
    compiler stack (about 1 s of CPU) and scipy.optimize (0.3 s) load where they are first
    used, not at import."""
    heavy = ("torch._dynamo", "scipy.optimize")
    code = f"import sys, moebalance; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]", f"import moebalance loaded {out.strip()}"
