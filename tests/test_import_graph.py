"""The package's imports point one way: no cycles, imports inside functions included.

docs/design.md draws the order (kernels <- model <- hooks/probe <- trace <- analysis <- figures <-
dashboards/reports/cli). This test reads every module of the installed package's source folders
with `ast` (nothing is imported), resolves each `import` and `from ... import` to the project
module it names, wherever it stands in the file, and fails on any cycle, naming it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# import name of each top-level folder (setup.py's folder map)
FOLDERS = {
    "attnres_probe": ROOT / "attnres_probe",
    "attnres_probe.kernels": ROOT / "kernels",
    "attnres_probe.hooks": ROOT / "hooks",
    "attnres_probe.dashboards": ROOT / "dashboards",
    "attnres_probe.reports": ROOT / "reports",
}


def project_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts)) if parts else package
            if package == "attnres_probe" and parts and parts[0] in {"kernels", "hooks", "dashboards", "reports"}:
                continue  # not a folder of attnres_probe/ itself
            modules[name] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` points at (a module, or the package holding a name)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` imports the module pkg.mod where there is one, else a name of pkg
            names = [
                f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_walker_finds_a_cycle(tmp_path):
    """The check can fail: two modules that import each other inside functions are a cycle."""
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py"}
    modules["pkg.a"].write_text("def f():\n    from pkg import b\n")
    modules["pkg.b"].write_text("def g():\n    from .c import x\n")
    modules["pkg.c"].write_text("import pkg.a\n")
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
