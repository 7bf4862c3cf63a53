"""The package's layout rules (docs/architecture.md), checked on the source: module and function
size, a docstring per module, the stages and their import order, no import cycle (imports inside
functions included), no printing outside the CLI."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "oomdoctor"
MAX_LINES = 600
MAX_FUNCTION_LINES = 80
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


# The pipeline's stages, in the order data flows (docs/architecture.md). A module may import
# its own stage and the stages before it; ``configs`` and ``explain`` (no torch) import none.
STAGES = {"configs": 0, "explain": 0, "models": 1, "sim": 2, "plans": 3, "runs": 4}
TOP = 5                             # cli, api, __main__ and the package itself use every stage


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """oomdoctor modules this module imports, inside functions too unless ``top_level_only``.
    ``from P import n`` is an import of module ``P.n`` when there is one, else of ``P``'s
    namespace; the package version (``from oomdoctor import __version__``) is a constant."""
    tree = ast.parse(path.read_text())
    own = _name(path)
    pkg = own if path.name == "__init__.py" else own.rpartition(".")[0]
    known = {_name(p) for p in MODULES}
    out = set()
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("oomdoctor")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                          # relative: from . import x
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("oomdoctor"):
                continue
            for a in node.names:
                if (base, a.name) != ("oomdoctor", "__version__"):
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out - {own}


def _import_graph() -> dict[str, set[str]]:
    """Every import, function-level ones included. Importing ``a.b.c`` also runs the
    ``__init__`` of ``a`` and ``a.b``, so their module-level imports count as well."""
    explicit = {_name(p): _imports(p) for p in MODULES}
    eager = {_name(p): _imports(p, top_level_only=True) for p in MODULES}
    graph = {}
    for m, targets in explicit.items():
        parents = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 1)}
        graph[m] = targets | {a for a in parents
                              if eager.get(a) and a != m and not m.startswith(a + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path (first == last), or [] when there is none."""
    state: dict[str, int] = {}                  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str]:
        if state.get(m) == 1:
            return path[path.index(m):] + [m]
        if state.get(m) == 2:
            return []
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if found := visit(n, path + [m]):
                return found
        state[m] = 2
        return []

    for m in sorted(graph):
        if found := visit(m, []):
            return found
    return []


def _stage(module: str) -> int:
    parts = module.split(".")
    return STAGES.get(parts[1], TOP) if len(parts) > 1 else TOP


def test_no_import_cycle_counting_imports_inside_functions():
    """No cycle, whether the import runs when the module loads or when a function first runs;
    a submodule importing its own package back while the package imports it counts as one."""
    assert _cycle(_import_graph()) == []


def test_the_cycle_check_sees_function_level_imports():
    graph = {"a": {"b"}, "b": set()}
    assert _cycle(graph) == []
    graph["b"].add("a")
    assert _cycle(graph) == ["a", "b", "a"]


def test_no_stage_imports_a_later_one():
    """models -> sim -> plans -> runs: a stage imports only itself and earlier stages;
    configs and explain import no stage."""
    upward = sorted(f"{a} -> {b}" for a, targets in _import_graph().items() for b in targets
                    if _stage(b) > _stage(a)
                    or (_stage(a) == _stage(b) == 0 and a.split(".")[1] != b.split(".")[1]))
    assert upward == []


def test_the_package_shows_the_pipeline():
    """A reader who opens oomdoctor/ sees the stages, not a flat list of modules."""
    entries = sorted(p.name for p in PKG.iterdir() if p.name != "__pycache__")
    assert {"models", "sim", "plans", "runs", "explain", "cli"} <= set(entries)
    assert len(entries) <= 12, entries


def test_each_stage_package_says_what_it_owns_and_may_import():
    """A stage's __init__ is its docstring only: importing one module of a stage never loads
    the others, and the docstring is where a reader learns the stage's rules."""
    for stage in ("models", "sim", "plans", "runs"):
        tree = ast.parse((PKG / stage / "__init__.py").read_text())
        doc = ast.get_docstring(tree)
        assert doc and "Owns" in doc and "Imports:" in doc, stage
        assert len(tree.body) == 1, f"{stage}/__init__.py has code besides its docstring"


def test_no_function_is_over_80_lines():
    """Functions read top-down as named steps; a long one is split where its logic lives."""
    long = []
    for path, name in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert long == []


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
