"""The package's layout rules: no import circle between dsa_convert's modules, no module over 600 lines.

The import graph is read from the source with `ast` (nothing is imported): every `import dsa_convert.x`,
`from dsa_convert.x import y` and relative `from .x import y` / `from . import y`, at module level or inside a
function (a late import still ties the two modules together), is an edge from the importing module to the
imported one; `from pkg import name` counts as an edge to `pkg.name` when that is a module, else to `pkg`.
A package's `__init__` is the module `pkg` itself.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "dsa_convert"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module `name` names (itself, or the nearest package above it that exists), or None outside the package."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]   # the package relative imports start from
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == PACKAGE:
                mod = node.module
            else:
                continue
            for a in node.names:   # `from pkg import sub` imports the module pkg.sub when it is one
                targets.append(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
        for t in targets:
            r = _resolve(t, known)
            if r is not None and r != name:
                out.add(r)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None. A package's `__init__` importing its own
    submodules is an edge like any other, so `cli -> pipeline (__init__) -> pipeline.runner -> cli` is a circle."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {n: WHITE for n in graph}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        colour[n] = GREY
        stack.append(n)
        for m in sorted(graph[n]):
            if colour[m] == GREY:
                return stack[stack.index(m):] + [m]
            if colour[m] == WHITE and (c := visit(m)) is not None:
                return c
        stack.pop()
        colour[n] = BLACK
        return None

    for n in sorted(graph):
        if colour[n] == WHITE and (c := visit(n)) is not None:
            return c
    return None


def test_graph_sees_the_package():
    """The walk finds the modules and the edges it should (a broken walk would find no circle anywhere)."""
    g = import_graph()
    assert {"dsa_convert.cli", "dsa_convert.pipeline.runner", "dsa_convert.pipeline.commands"} <= set(g)
    assert "dsa_convert.pipeline" in g["dsa_convert.cli"]              # `from .pipeline import run` in a function
    assert "dsa_convert.pipeline.runner" in g["dsa_convert.pipeline"]          # a package's __init__ counts
    assert "dsa_convert.pipeline.commands" in g["dsa_convert.pipeline.runner"]
    assert "dsa_convert.errors" in g["dsa_convert.pipeline.runner"]    # `from ..errors import BadInputError`


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert find_cycle({"p": {"p.x"}, "p.x": set()}) is None
    # the circle this test was written for: the CLI imports the pipeline package, whose __init__ imports its runner
    old = {"dsa_convert.cli": {"dsa_convert.pipeline"}, "dsa_convert.pipeline": {"dsa_convert.pipeline.runner"},
           "dsa_convert.pipeline.runner": {"dsa_convert.cli"}}
    assert find_cycle(old) == ["dsa_convert.cli", "dsa_convert.pipeline", "dsa_convert.pipeline.runner",
                               "dsa_convert.cli"]


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_pipeline_does_not_import_the_cli():
    g = import_graph()
    offenders = sorted(n for n, deps in g.items() if n.startswith("dsa_convert.pipeline") and "dsa_convert.cli" in deps)
    assert not offenders, offenders


def test_no_module_over_600_lines():
    long = {name: n for name, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"
