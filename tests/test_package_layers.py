"""The package is layered: each part imports only parts below it, so it reads and changes bottom-up.

From the top: the face (the command, the doctor and the estimate, `train`/`main` and the one-file commands
(`commands/`), starting processes), the engine (`engine/`: the loop, preparation, the step, evaluation), the ways
a run stops, what it records (`observe/`), checkpoints, optimizers, schedules and the EMA (`optim/`), data, the
layouts (`parallel/`), the recipe contract and its parts (`contract/`), the configuration (`config/`, a leaf over
`errors`). Every import counts, also one inside a function or under TYPE_CHECKING: a lazy
import is still a dependency.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict

from conftest import REPO

PACKAGE = REPO / "accel_trainer"
LAYERS = [  # bottom first; a unit is a top-level module or a whole package
    {"errors", "console"},
    {"host"},
    {"config"},
    {"contract"},
    {"recipe"},
    {"registry"},
    {"parallel"},
    {"data"},
    {"optim"},
    {"checkpoint"},
    {"observe"},
    {"stopping"},
    {"engine"},
    {"processes"},
    {"training", "commands"},
    {"doctor", "estimate"},
    {"cli"},
    {"__main__", "__init__"},
]
FLOOR = {unit: floor for floor, units in enumerate(LAYERS) for unit in units}


def module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports() -> dict[str, set[str]]:
    """Each module's imports of other accel_trainer modules (a name imported from a package that is a module
    counts as that module)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("accel_trainer"):
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            graph[module] |= {name for name in names if name in modules and name not in (module, "accel_trainer")}
    return graph


def test_every_module_belongs_to_a_layer():
    units = {unit_of(module_name(path)) for path in PACKAGE.rglob("*.py")}
    assert units - set(FLOOR) == set(), "add the new module or package to LAYERS"


def test_every_import_goes_down_a_layer_or_stays_within_its_package():
    upward = []
    for module, targets in sorted(imports().items()):
        for target in sorted(targets):
            here, there = unit_of(module), unit_of(target)
            if here != there and FLOOR[there] >= FLOOR[here]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_there_is_no_import_cycle_between_modules():
    graph, state, cycles = imports(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in graph.get(module, ()):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_configuration_is_a_leaf_over_the_errors():
    for module, targets in imports().items():
        if unit_of(module) == "config":
            assert {unit_of(target) for target in targets} <= {"config", "errors"}, (module, targets)


def test_the_top_level_holds_only_the_face_and_the_contract():
    top = {path.stem for path in PACKAGE.glob("*.py")}
    face = {"__init__", "__main__", "cli", "training", "processes", "errors"}
    contract = {"recipe", "registry"}
    assert top == face | contract


def test_no_import_renames_a_module_of_the_package():
    """A module is read under its own name (`from accel_trainer.checkpoint import files`, then `files.verify`),
    never under an alias that brings back a name from before a move (`files as checkpoint_files`)."""
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    renamed = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("accel_trainer"):
                renamed += [
                    f"{module_name(path)}: {node.module}.{alias.name} as {alias.asname}"
                    for alias in node.names
                    if alias.asname and f"{node.module}.{alias.name}" in modules
                ]
    assert renamed == []


def test_each_package_names_its_owner_or_entry_point_and_they_exist():
    """A newcomer opening a package's __init__.py learns where to start reading: an `Owner:` or `Entry point(s):`
    line, whose backticked `module.Name`s are defined in that package."""
    missing = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if init.parent == PACKAGE:
            continue
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = re.findall(r"(?:Owner|Entry points?)(?: \([^)]*\))?: (.*?)(?:\n\n|$)", docstring, re.S)
        if not named:
            missing.append(f"{init.parent.name}: no Owner: or Entry point: line")
        for module, name in re.findall(r"`([a-z_]+)\.([A-Za-z_]+)`", " ".join(named)):
            if name == "py":  # a file named beside them
                continue
            source = init.parent / f"{module}.py"
            defined = source.is_file() and any(
                isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name
                for node in ast.parse(source.read_text()).body
            )
            if not defined:
                missing.append(f"{init.parent.name}: {module}.{name}")
    assert missing == []
