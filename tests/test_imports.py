"""The package's rooms import one way only, floor by floor, and nothing imports itself back through a cycle.

Read from the source with an `ast` walk. Imports inside functions count like module-level ones (a function-level
import is still an arrow between rooms; only `TYPE_CHECKING` blocks, which never run, are left out), and every
function-level import of a `topp_rl` module must be on `LAZY`, with its reason. `python tests/test_imports.py`
prints the floor table that docs/ARCHITECTURE.md shows (the test checks that the doc holds it as printed).
"""

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Bottom floor first. A room may import the rooms on the floors below its own (and itself), never a room on its
# own floor or above, less the exclusions in APART. The entry floor holds the top-level modules of `topp_rl`,
# which may import each other.
FLOORS: list[tuple[str, list[str], str]] = [
    ("leaves", ["topp_rl.paths", "topp_rl.ops"], "where the shipped config / data are; pure numerics"),
    ("contracts", ["topp_rl.data", "topp_rl.parallel", "topp_rl.losses"],
     "samples, packed batches, sampling params; the parallel layout and collectives; the RL losses"),
    ("models, serving", ["topp_rl.models", "topp_rl.engines.serving"],
     "tiny / SmolLM2 / HF dir builders, MoE route recording and replay; the engine-neutral serving layer (HTTP "
     "client, processes, wire format, weight broadcast), which imports no engine"),
    ("rollout parts", ["topp_rl.engines", "topp_rl.tasks"], "engines (embedded, SGLang, serving); tasks, rewards"),
    ("rollout", ["topp_rl.rollout"], "the rollout step, the datamodule, advantages, packing, TP x CP sharing"),
    ("trainer", ["topp_rl.trainer"], "PolicyModule, backbone protocol, scorer hook, LoRA, metrics, precision"),
    ("run", ["topp_rl.run"], "run dir, checkpoints, export, signals, console, loggers, sweeps, summary"),
    ("strategies", ["topp_rl.fsdp", "topp_rl.megatron"], "FSDP2 and Megatron-core backbones and strategies"),
    ("callbacks, report", ["topp_rl.callbacks", "topp_rl.report"], "Lightning callbacks; the report command"),
    ("entry", ["topp_rl", "topp_rl.config_keys", "topp_rl.config", "topp_rl.train", "topp_rl.api", "topp_rl.cli",
               "topp_rl.export"], "config checks, train(cfg), fit / compose, the topp-rl and export commands"),
]
# Rooms kept apart although a floor lies between them: the trainer and the strategies see rollouts only as data
# (packed batches), never an engine, a task or the rollout pipeline.
APART = {
    "topp_rl.trainer": {"topp_rl.engines", "topp_rl.tasks", "topp_rl.rollout"},
    "topp_rl.fsdp": {"topp_rl.engines", "topp_rl.tasks", "topp_rl.rollout"},
    "topp_rl.megatron": {"topp_rl.engines", "topp_rl.tasks", "topp_rl.rollout"},
}
# Function-level imports of topp_rl modules, each with its reason (importer, imported): anything else is imported
# at the top of its module.
LAZY = {
    ("topp_rl", "topp_rl.api"): "`import topp_rl` stays light (no Lightning, no models): lazy package attributes",
    ("topp_rl", "topp_rl.trainer.hook"): "`import topp_rl` stays light: `topp_rl.ToppLogProb` loads on first use",
    ("topp_rl.api", "topp_rl.train"): "compose() needs Hydra only; Lightning and the models load in fit()",
    ("topp_rl.api", "topp_rl.config"): "compose() needs Hydra only; the config checks import every part",
    ("topp_rl.api", "topp_rl.run.rundir"): "compose() needs Hydra only; the run name and run dir checks load torch",
    ("topp_rl.cli", "topp_rl.train"): "`topp-rl --help` and `train --help` answer without importing Lightning",
    ("topp_rl.cli", "topp_rl.run.export"): "each subcommand loads only what it runs",
    ("topp_rl.cli", "topp_rl.report"): "each subcommand loads only what it runs (matplotlib for report)",
    ("topp_rl.cli", "topp_rl.api"): "each subcommand loads only what it runs (plan composes a config)",
    ("topp_rl.cli", "topp_rl.config"): "each subcommand loads only what it runs (plan checks the config)",
    ("topp_rl.cli", "topp_rl.parallel.placement"): "each subcommand loads only what it runs (plan renders it)",
}

PACKAGE_DIRS = {"callbacks": "topp_rl.callbacks"}  # folders installed under another name (pyproject's package-dir)
DATA_DIRS = {"conf": "topp_rl.resources.conf", "data": "topp_rl.resources.data"}  # package data, no code


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


def _imported(node: ast.AST, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("topp_rl")}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("topp_rl"):
        names = {f"{node.module}.{a.name}" for a in node.names}
        if not known:
            return {node.module} | names
        return (names & known) or {node.module}  # `from package import submodule`: the submodule
    return set()


def imports(path: Path, known: set[str] = frozenset()) -> tuple[set[str], set[str]]:
    """(the `topp_rl` modules `path` imports when it is imported, those its functions import when they run);
    `TYPE_CHECKING` blocks are left out."""
    eager: set[str] = set()
    lazy: set[str] = set()
    stack = [(n, False) for n in ast.parse(path.read_text(), filename=str(path)).body]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack += [(n, in_function) for n in node.orelse]
            continue
        (lazy if in_function else eager).update(_imported(node, known))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        stack += [(child, inner) for child in ast.iter_child_nodes(node)]
    return eager, lazy


def _targets(name: str, imported: set[str], modules: set[str]) -> set[str]:
    """The modules an import runs: each one named, and its packages, except the importer's own packages (Python
    has started those already; `from <own package> import <submodule>` is an edge only to the submodule)."""
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    targets = set()
    for module in imported & modules:
        parts = module.split(".")
        targets |= {module} | ({".".join(parts[:i]) for i in range(2, len(parts))} & modules) - own
    for package in targets & own:
        if any(t.startswith(package + ".") for t in imported):
            targets.discard(package)
    return targets - {name}


def graph(*, lazy: bool = True) -> dict[str, set[str]]:
    """module -> the modules it imports (function-level imports included unless `lazy=False`)."""
    paths = {module_name(p): p for p in source_files()}
    modules = set(paths)
    edges = {}
    for name, path in paths.items():
        eager, late = imports(path, modules)
        edges[name] = _targets(name, eager | late if lazy else eager, modules)
    return edges


def lazy_imports() -> set[tuple[str, str]]:
    """(importer, the module a function-level import names)."""
    paths = {module_name(p): p for p in source_files()}
    return {(name, target) for name, path in paths.items() for target in imports(path, set(paths))[1]}


def room(module: str) -> str:
    rooms = [r for _, members, _ in FLOORS for r in members]
    matches = [r for r in rooms if module == r or module.startswith(r + ".")]
    assert matches, f"{module} lies in no room of FLOORS: add it to a floor"
    return max(matches, key=len)


def floor(r: str) -> int:
    return next(i for i, (_, members, _) in enumerate(FLOORS) if r in members)


def allowed(mine: str, theirs: str) -> bool:
    entry = len(FLOORS) - 1  # the entry modules call each other (cycles among them are still refused)
    return (mine == theirs or floor(mine) == floor(theirs) == entry
            or (floor(theirs) < floor(mine) and theirs not in APART.get(mine, set())))


def upward_arrows(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} imports {target} ({room(module)} may not import {room(target)})"
                  for module, targets in edges.items() for target in targets
                  if not allowed(room(module), room(target)))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: list[str] = []
    found = []

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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def floor_table() -> str:
    """The markdown table of docs/ARCHITECTURE.md: floors top first, each with its rooms and what they hold."""
    lines = ["| floor | rooms | holds | may also not import |", "|---|---|---|---|"]
    for i, (name, members, holds) in reversed(list(enumerate(FLOORS))):
        apart = sorted({a for m in members for a in APART.get(m, ())})
        lines.append(f"| {i} {name} | {', '.join(f'`{m}`' for m in members)} | {holds} | "
                     f"{', '.join(f'`{a}`' for a in apart)} |")
    return "\n".join(lines)


def test_rooms_import_one_way_only():
    wrong = upward_arrows(graph())
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_counting_function_level_imports():
    assert not cycles(graph()), cycles(graph())


def test_function_level_imports_are_the_listed_ones():
    found = lazy_imports()
    assert not found - LAZY.keys(), f"function-level imports not in LAZY (import them at the top): {found - LAZY.keys()}"
    assert not LAZY.keys() - found, f"LAZY entries no longer imported lazily (drop them): {LAZY.keys() - found}"


def test_the_checks_see_upward_arrows_cycles_and_lazy_imports():
    edges = {"topp_rl.trainer.module": {"topp_rl.run.export"}, "topp_rl.run.export": {"topp_rl.trainer.module"}}
    assert upward_arrows(edges) == ["topp_rl.trainer.module imports topp_rl.run.export (topp_rl.trainer may not "
                                    "import topp_rl.run)"]
    assert cycles(edges) == [["topp_rl.run.export", "topp_rl.trainer.module"]]
    assert upward_arrows({"topp_rl.fsdp.strategy": {"topp_rl.rollout.datamodule"}})  # apart, though below


def test_the_walk_sees_imports_function_level_ones_apart(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nimport topp_rl.ops\nfrom topp_rl.data import Sample\n"
                      "if TYPE_CHECKING:\n    from topp_rl.rollout import x\n"
                      "try:\n    from topp_rl.tasks import y\nexcept ImportError:\n    pass\n"
                      "def f():\n    from topp_rl.train import train\n"
                      "class C:\n    def g(self):\n        import topp_rl.run.export\n")
    assert imports(source) == ({"topp_rl.ops", "topp_rl.data", "topp_rl.data.Sample", "topp_rl.tasks",
                                "topp_rl.tasks.y"}, {"topp_rl.train", "topp_rl.train.train", "topp_rl.run.export"})


def test_the_architecture_doc_shows_the_floors():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert floor_table() in doc, "docs/ARCHITECTURE.md: paste the output of `python tests/test_imports.py`"


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "topp_rl").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top


def test_pyproject_installs_every_package():
    """The package list is written out (a folder is mapped), so a new subpackage must be added to it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {module_name(p) for p in source_files() if p.name == "__init__.py"} | set(DATA_DIRS.values())
    assert sorted(setuptools["packages"]) == sorted(on_disk)
    assert setuptools["package-dir"] == {v: k for k, v in (PACKAGE_DIRS | DATA_DIRS).items()}
    assert not [p for folder in DATA_DIRS for p in (ROOT / folder).rglob("*.py")]  # data only: no code there


if __name__ == "__main__":
    sys.exit(print(floor_table()))
