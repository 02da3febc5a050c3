"""The package's rooms import one way only (ops <- data <- engines, tasks <- rollout pipeline <- the rest), and
no module of `topp_rl` imports itself back through a cycle. Read from the source (an `ast` walk of the
module-level imports; imports inside functions and under `TYPE_CHECKING` are lazy on purpose and not counted)."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Room -> the rooms it may import from (itself included). Rooms not listed here are not constrained, but take
# part in the cycle check.
ALLOWED = {
    "topp_rl.ops": {"topp_rl.ops"},
    "topp_rl.data": {"topp_rl.ops", "topp_rl.data"},
    # topp_rl.moe: the HF MoE router hooks, shared by the engine (records routes) and the trainer (replays them).
    "topp_rl.moe": {"topp_rl.data", "topp_rl.moe"},
    # The engine-neutral serving layer (before topp_rl.engines: the first matching room wins) imports no engine.
    "topp_rl.engines.serving": {"topp_rl.ops", "topp_rl.data", "topp_rl.engines.serving"},
    "topp_rl.engines": {"topp_rl.ops", "topp_rl.data", "topp_rl.moe", "topp_rl.engines.serving", "topp_rl.engines"},
    # topp_rl.paths: where the shipped config and data are (a leaf: it imports nothing of topp_rl).
    "topp_rl.paths": {"topp_rl.paths"},
    "topp_rl.tasks": {"topp_rl.data", "topp_rl.paths", "topp_rl.tasks"},
    "topp_rl.rollout": {"topp_rl.ops", "topp_rl.data", "topp_rl.engines", "topp_rl.tasks", "topp_rl.parallel",
                        "topp_rl.rollout"},
}


# Folders installed under another name (pyproject's package-dir): the callbacks folder is `topp_rl.callbacks`.
PACKAGE_DIRS = {"callbacks": "topp_rl.callbacks"}
# Folders without Python installed as package data (their files through pyproject's package-data).
DATA_DIRS = {"conf": "topp_rl.resources.conf", "data": "topp_rl.resources.data"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = (*PACKAGE_DIRS.get(parts[0], parts[0]).split("."), *parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    return [p for folder in ("topp_rl", *PACKAGE_DIRS) for p in (ROOT / folder).rglob("*.py")]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def eager_imports(path: Path) -> set[str]:
    """The `topp_rl` modules `path` imports when it is imported (module level, `try` blocks included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack += node.orelse
            continue
        if isinstance(node, ast.If | ast.Try | ast.With):
            stack += [n for block in ("body", "orelse", "finalbody", "handlers") for n in getattr(node, block, [])]
        elif isinstance(node, ast.ExceptHandler):
            stack += node.body
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("topp_rl")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("topp_rl"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # kept where it names a submodule
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in source_files()}
    edges = {}
    for name, path in modules.items():
        imports = eager_imports(path) & modules.keys()
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # its packages
        targets = set()
        for imported in imports:
            # Importing topp_rl.x.y runs the package topp_rl.x first, unless it is the importer's own package,
            # which Python has started already (`from topp_rl.x import y` with y a submodule is such an import).
            parts = imported.split(".")
            targets |= {imported} | ({".".join(parts[:i]) for i in range(2, len(parts))} & modules.keys()) - own
        for package in targets & own:  # `from <own package> import <name>`: an edge only for non-module names
            if not any(t.startswith(package + ".") for t in imports):
                continue
            targets.discard(package)
        edges[name] = targets - {name}
    return edges


def room(module: str) -> str | None:
    return next((r for r in ALLOWED if module == r or module.startswith(r + ".")), None)


def test_rooms_import_one_way_only():
    wrong = []
    for module, targets in graph().items():
        mine = room(module)
        if mine is None:
            continue
        for target in targets:
            theirs = room(target) or ".".join(target.split(".")[:2])
            if theirs not in ALLOWED[mine]:
                wrong.append(f"{module} imports {target} ({mine} may import {sorted(ALLOWED[mine])})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        on_stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = on_stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_walk_sees_imports_and_skips_lazy_ones(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nimport topp_rl.ops\nfrom topp_rl.data import Sample\n"
                      "if TYPE_CHECKING:\n    from topp_rl.rollout import x\n"
                      "try:\n    from topp_rl.tasks import y\nexcept ImportError:\n    pass\n"
                      "def f():\n    from topp_rl.train import train\n")
    assert eager_imports(source) == {"topp_rl.ops", "topp_rl.data", "topp_rl.data.Sample", "topp_rl.tasks",
                                     "topp_rl.tasks.y"}


def test_pyproject_installs_every_package():
    """The package list is written out (a folder is mapped), so a new subpackage must be added to it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {module_name(p) for p in source_files() if p.name == "__init__.py"} | set(DATA_DIRS.values())
    assert sorted(setuptools["packages"]) == sorted(on_disk)
    assert setuptools["package-dir"] == {v: k for k, v in (PACKAGE_DIRS | DATA_DIRS).items()}
    assert not [p for folder in DATA_DIRS for p in (ROOT / folder).rglob("*.py")]  # data only: no code there
