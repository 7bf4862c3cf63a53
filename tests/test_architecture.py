"""The package's layout rules (docs/architecture.md), checked on the source: module size, a
docstring per module, no import cycle at import time, no printing outside the CLI."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "oomdoctor"
MAX_LINES = 600
MODULES = {p: ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
           for p in sorted(PKG.rglob("*.py"))}


def _name(path: Path) -> str:
    name = MODULES[path]
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def test_no_module_is_over_the_size_limit():
    long = {MODULES[p]: n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_module_says_what_it_is():
    assert [MODULES[p] for p in MODULES if ast.get_docstring(ast.parse(p.read_text())) is None] == []


def _module_level_imports(path: Path) -> set[str]:
    """oomdoctor modules imported when this module is imported (not inside functions)."""
    tree = ast.parse(path.read_text())
    out = set()
    pkg = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("oomdoctor")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                          # relative: from . import x
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.startswith("oomdoctor"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    known = {_name(p) for p in MODULES}
    return {m for m in out if m in known} - {_name(path)}


def test_no_import_cycle_at_import_time():
    """Imports at module level (not the lazy ones inside functions) form no cycle; a submodule
    importing its own package back while the package imports it counts as one."""
    graph = {_name(p): _module_level_imports(p) for p in MODULES}
    done: set[str] = set()

    def cycle_from(m: str, stack: list[str]) -> list[str]:
        if m in stack:
            return stack[stack.index(m):] + [m]
        if m in done:
            return []
        for n in sorted(graph.get(m, ())):
            found = cycle_from(n, stack + [m])
            if found:
                return found
        done.add(m)
        return []

    cycles = [c for m in sorted(graph) if (c := cycle_from(m, []))]
    assert cycles == []


def test_library_code_never_prints():
    """Only the CLI writes to the terminal; library modules return results (house habit 3)."""
    offenders = []
    for path, name in MODULES.items():
        if name.startswith("oomdoctor.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id == "print") or (
                        isinstance(f, ast.Attribute) and f.attr == "echo"):
                    offenders.append(f"{name}:{node.lineno}")
    assert offenders == []
