"""The house has floors: no module imports from a higher floor, and no imports run in circles;
the ground floor holds no method's own data structure, and the engine imports no transformers.

Floors, bottom up (a package may import only from strictly lower floors, or within itself):
core and version; machine, the shared CLI arguments and the kernels; models and the zoo; drafters,
diffusion and diffusion LMs; the engine and the vLLM bridge; lossy approximations and the grammar engine; the API and the exporters; training, the benchmark and the server;
the command line; the package's front door; the demo and `python -m hasten`, which use it as a user would.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
FLOORS = {
    "core": 0, "version": 0,
    "machine": 1, "arguments": 1,
    "kernels": 1,  # hasten's own C kernels (built on first use) and their torch-facing calls
    "models": 2, "zoo": 2,
    "drafters": 3, "diffusion": 3, "dlm": 3,
    "engine": 4,
    "vllm": 4,  # loaded inside vLLM's own environment: the drafters, never models (test below)
    "approx": 5, "loading": 5,
    "structured": 5,  # the grammar engine behind core.constraint (an optional extra)
    "api": 6, "export": 6,  # export: a trained drafter in an engine's layout
    "training": 7, "bench": 7, "serve": 7,
    "cli": 8,
    "__init__": 9,
    "__main__": 10, "demo": 10,  # the demo uses the public API as a user would
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(name: str) -> bool:
    return (SRC / name.replace(".", "/") / "__init__.py").is_file()


def exists(name: str) -> bool:
    return is_package(name) or (SRC / (name.replace(".", "/") + ".py")).is_file()


def imports_of(path: Path) -> set[str]:
    """hasten modules imported anywhere in the file (function-local imports included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hasten")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hasten":
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if exists(sub) else target)
    return {m for m in found if m != name}


def floor_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in FLOORS, f"module {module} belongs to no floor: add its package to FLOORS"
    return top, FLOORS[top]


GRAPH = {module_name(p): imports_of(p) for p in sorted((SRC / "hasten").rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_from_a_higher_floor(module):
    home, floor = floor_of(module)
    for target in sorted(GRAPH[module]):
        where, target_floor = floor_of(target)
        if where == home:
            continue
        assert target_floor < floor, f"{module} (floor {floor}, {home}) imports {target} (floor {target_floor}, {where})"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            if target not in GRAPH:
                continue
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target] if target in path else [module, target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if not state.get(target):
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if not state.get(module):
            visit(module, [module])


def test_the_graph_is_read():
    """The checks above mean something only if imports are found."""
    assert "hasten.core.tree" in GRAPH["hasten.drafters.candidates"]
    assert "hasten.models.cache" in GRAPH["hasten.models.adapter"]
    assert "hasten.drafters.base" in GRAPH["hasten.engine.loop"]


def reachable(module: str) -> set[str]:
    """Every hasten module ``module`` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for target in GRAPH.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_drafters_base_and_the_vllm_bridge_import_no_model_code():
    """The row contract is on the ground floor: the drafter protocol, and hasten.vllm with the
    drafters it wraps, reach no hasten.models module (statically) and load without
    transformers (in a fresh interpreter)."""
    import subprocess
    import sys

    for module in ("hasten.drafters.base", "hasten.vllm"):
        assert not {m for m in reachable(module) if m.startswith("hasten.models")}, module
    assert {"hasten.drafters.prompt_lookup", "hasten.drafters.lookahead", "hasten.drafters.suffix"} <= \
        reachable("hasten.vllm")
    code = ("import sys, hasten.vllm; "
            "bad = sorted(m for m in sys.modules if m.startswith('hasten.models') or m.split('.')[0] == 'transformers'); "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_ground_floor_holds_no_methods_own_data_structure():
    """core/ holds contracts (rows, requests, settings, constraint, the pool contract) and values
    every floor uses: each of its modules is imported from outside core, and not by drafters
    alone (a pool, tree or index that only drafters read is a method's own, beside its drafter)."""
    users: dict[str, set[str]] = {m: set() for m in GRAPH if m.startswith("hasten.core.")}
    for module, targets in GRAPH.items():
        home, _ = floor_of(module)
        for target in targets & users.keys():
            if home != "core":
                users[target].add(home)
    grown = True
    while grown:  # a core module that other core modules import serves their users too
        grown = False
        for module in users:
            for target in GRAPH[module] & users.keys():
                if not users[module] <= users[target]:
                    users[target] |= users[module]
                    grown = True
    alone = {m: sorted(u) for m, u in users.items() if u <= {"drafters"}}
    assert not alone, f"core modules only drafters use (or none outside core; move each beside its drafter): {alone}"


def runtime_imports_of_transformers(source: str) -> list[int]:
    """Lines of ``source`` that import transformers outside an ``if TYPE_CHECKING:`` block
    (function-local imports included: they run too)."""
    def type_checking(test: ast.expr) -> bool:
        return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
            (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")

    def visit(node: ast.AST) -> list[int]:
        if isinstance(node, ast.If) and type_checking(node.test):
            return [line for child in node.orelse for line in visit(child)]
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "transformers" for a in node.names):
            return [node.lineno]
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "transformers":
            return [node.lineno]
        return [line for child in ast.iter_child_nodes(node) for line in visit(child)]

    return visit(ast.parse(source))


@pytest.mark.parametrize("path", sorted((SRC / "hasten" / "engine").rglob("*.py")), ids=lambda p: p.name)
def test_the_engine_imports_no_transformers(path):
    """The engine speaks to runtimes, never to transformers: its type hints of transformers'
    classes are imported under ``TYPE_CHECKING`` only."""
    lines = runtime_imports_of_transformers(path.read_text())
    assert not lines, f"{path.name} imports transformers at run time, line(s) {lines}"


def test_the_transformers_check_finds_run_time_imports_only():
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from transformers import PreTrainedModel\n"
              "def load():\n    import transformers.utils\n"
              "from transformers import AutoTokenizer\n")
    assert runtime_imports_of_transformers(source) == [5, 6]
