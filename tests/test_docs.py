"""The documentation stays a map of the code: the README fits on a page, and every name of this repository's code
that README.md or a page of docs/ gives exists. The site itself is built by `make docs` (mkdocs, strict: broken
links between pages fail it); this test checks what mkdocs cannot, the names of code.

What counts as a reference, and what it must name (anywhere in the text: prose, tables, inline code, code blocks,
unless the rule says otherwise):

1. A path ending in `.py`, with a folder (`accel_trainer/checkpoint/save.py`, `parallel/verbs.py`,
   `recipes/gpt.py`, `unit/data/test_stream_split.py`) or without (`loop.py`). With a folder it must exist from the
   repository root, from accel_trainer/ or from tests/; a bare file name must be a file somewhere under SOURCE_FOLDERS.
   Followed by `::name` (a pytest node id, `[params]` ignored) or `:name`, that file must also define `name` (a
   function or a class, at any depth). The files the docs ask the reader to create (EXAMPLE_FILES) are not ours.
2. A dotted name starting `accel_trainer.` or `at.` (the docs' `import accel_trainer as at`): each part must be a
   subpackage, a module, or a name the part before defines (a function, class, assignment or import; for a class,
   its methods, its fields and the attributes its methods set on `self`, its base classes' included).
   NOT_PYTHON_NAMES are dotted names that are no Python name (an entry-point group).
3. In inline code (backticks), a dotted name `a.b` or `a.b.c` whose first part is a lowercase identifier: when `a`
   is the name of a module or package of accel_trainer/ or recipes/ (`launch_fixes.forget_accelerate_state`,
   `restore.step_hooks_silenced`), the rest must be defined in one of the modules of that name, as in rule 2. When
   it is none of ours, it is skipped if Python can import it (`torch.save`, `os._exit`) or if it is one of the
   words the docs use for an object (OBJECT_WORDS: `model.module`, `accelerator.backward`), and otherwise reported:
   a module that was renamed or removed (`checkpoint_restore.step_hooks_silenced`). In prose (outside backticks
   and code blocks) the same holds for a first part that is a module of ours. A backticked `Name.attr` whose
   `Name` is a class of accel_trainer/ must name a member of it.
   A dotted word whose last part is a file extension (`config.yaml`, `model.safetensors`) is a file, not a name.

Every stale reference is listed, one per line, as `file:line: reference (why)`.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

from conftest import REPO

README_MAX_LINES = 150
PACKAGE = REPO / "accel_trainer"
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SOURCE_FOLDERS = ("accel_trainer", "recipes", "tests", "benchmarks", "scripts", "deploy")
EXAMPLE_FILES = {"my_gpt.py", "my_recipe.py", "my_rewards.py"}  # `cp gpt my_gpt.py`, `new my_recipe`, grpo's rewards
NOT_PYTHON_NAMES = {"accel_trainer.recipes"}  # the entry-point group of installed recipes
OBJECT_WORDS = {"accelerator", "model", "optimizer", "scaler", "self", "cfg", "batch", "output", "q", "dcp", "mypkg",
                "project"}  # fmt: skip
FILE_EXTENSIONS = {"py", "yaml", "yml", "json", "jsonl", "md", "png", "txt", "safetensors", "gguf", "parquet", "csv",
                   "jinja", "sbatch", "toml", "sh", "pt", "bin", "html", "template"}  # fmt: skip

PATH = re.compile(r"(?<![\w./-])((?:\.{0,2}/)?(?:[\w-]+/)*[\w-]+\.py)(?![\w])(?:(?:::|:)(\w+))?")
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
INLINE_CODE = re.compile(r"(`+)((?:[^`\n]|\n(?![ \t]*\n))+?)\1")  # within a paragraph


# --- what the code defines ------------------------------------------------------------------------------------------


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body defines, at its top level or inside its `if`, `try` and `with` blocks."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        for block in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, ast.If | ast.Try | ast.With) and hasattr(node, block):
                names.update(definitions(getattr(node, block)))
    return names


@cache
def classes() -> dict[str, list[ast.ClassDef]]:
    """Every top-level class of accel_trainer/ and recipes/, by name."""
    found = defaultdict(list)
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "recipes").glob("*.py")]:
        for node in parsed(path).body:
            if isinstance(node, ast.ClassDef):
                found[node.name].append(node)
    return found


def class_members(node: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str]:
    members = set(definitions(node.body))
    for method in node.body:
        if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
            members |= {
                target.attr
                for target in ast.walk(method)
                if isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store)
                and isinstance(target.value, ast.Name) and target.value.id == "self"
            }  # fmt: skip
    for base in node.bases:  # a base of this package, found by its name
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        for base_node in classes().get(name, []) if name not in seen else []:
            members |= class_members(base_node, seen | {node.name})
    return members


def resolves(location: Path, parts: list[str]) -> bool:
    """Whether `parts` name something inside `location` (a package folder or a module file)."""
    scope: ast.AST | None = None
    for part in parts:
        if scope is None:
            if location.is_dir():
                if (location / part / "__init__.py").exists():
                    location = location / part
                    continue
                if (location / f"{part}.py").exists():
                    location = location / f"{part}.py"
                    continue
                location = location / "__init__.py"
            scope = definitions(parsed(location).body).get(part)
            if scope is None:
                return False
        elif isinstance(scope, ast.ClassDef):
            if part not in class_members(scope):
                return False
            scope = definitions(scope.body).get(part, ast.Pass())  # an attribute set in a method: nothing below it
        else:
            return True  # an attribute of a function's or a value's result: not something the source names
    return True


@cache
def our_modules() -> dict[str, list[Path]]:
    """Modules and packages of accel_trainer/ and recipes/ by their own name (`launch_fixes`, `checkpoint`)."""
    found = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            found[path.parent.name].append(path.parent)
        else:
            found[path.stem].append(path)
    for path in (REPO / "recipes").glob("*.py"):
        if path.name != "__init__.py":
            found[path.stem].append(path)
    return found


@cache
def files_named(name: str) -> list[Path]:
    return [path for folder in SOURCE_FOLDERS for path in (REPO / folder).rglob(name)]


@cache
def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# --- checking one reference -----------------------------------------------------------------------------------------


def path_problem(path: str, name: str | None) -> str | None:
    if Path(path).name in EXAMPLE_FILES:
        return None
    if "/" in path:
        candidates = [base / path.removeprefix("./") for base in (REPO, PACKAGE, REPO / "tests")]
        found = [candidate for candidate in candidates if candidate.is_file()]
        where = "the repository root, accel_trainer/ or tests/"
    else:
        found = files_named(path)
        where = ", ".join(f"{folder}/" for folder in SOURCE_FOLDERS)
    if not found:
        return f"no such file under {where}"
    if name is not None:
        defined = {node.name for file in found for node in ast.walk(parsed(file)) if hasattr(node, "name")}
        if name not in defined:
            return f"{path} defines no {name}"
    return None


def dotted_problem(name: str, in_code: bool) -> str | None:
    """Rules 2 and 3 for one dotted name; None when it is fine or not a reference."""
    parts = name.split(".")
    if parts[-1] in FILE_EXTENSIONS or name in NOT_PYTHON_NAMES:
        return None
    if parts[0] in ("accel_trainer", "at"):
        return None if resolves(PACKAGE, parts[1:]) else "not defined in accel_trainer"
    if parts[0][0].isupper():
        if not in_code or parts[0] not in classes():
            return None
        members = set().union(*(class_members(node) for node in classes()[parts[0]]))
        return None if parts[1] in members else f"class {parts[0]} has no member {parts[1]}"
    if parts[0] in OBJECT_WORDS:
        return None
    if parts[0] in our_modules():
        if any(resolves(location, parts[1:]) for location in our_modules()[parts[0]]):
            return None
        return f"{'.'.join(parts[1:])} is not defined in module {parts[0]}"
    if not in_code or importable(parts[0]):
        return None
    return f"no module {parts[0]} in accel_trainer/ or recipes/, and Python cannot import one"


def blanked(text: str, keep: list[bool]) -> str:
    """`text` with the characters not kept turned to spaces (newlines stay, so offsets and line numbers hold)."""
    return "".join(char if kept or char == "\n" else " " for char, kept in zip(text, keep, strict=True))


def markdown_parts(text: str) -> tuple[str, list[tuple[int, str]], str]:
    """The code blocks of a page, its inline code spans (offset, text; a span may cross lines within a paragraph)
    and its prose, each blanked elsewhere so that an offset in any of them is an offset in `text`."""
    in_block, in_blocks = False, []
    for line in text.splitlines(keepends=True):
        fence = line.lstrip().startswith(("```", "~~~"))
        in_blocks += [in_block and not fence] * len(line)
        in_block ^= fence
    outside_blocks = blanked(text, [not kept for kept in in_blocks])
    spans = [(match.start(2), match.group(2)) for match in INLINE_CODE.finditer(outside_blocks)]
    in_spans = [False] * len(text)
    for start, span in spans:
        in_spans[start : start + len(span)] = [True] * len(span)
    return blanked(text, in_blocks), spans, blanked(outside_blocks, [not kept for kept in in_spans])


def document_problems(document: Path) -> list[str]:
    """Every stale reference of one page, as `file:line: reference (why)`."""
    text = document.read_text()
    shown = document.relative_to(REPO) if document.is_relative_to(REPO) else document.name
    blocks, spans, prose = markdown_parts(text)
    found: list[tuple[int, str, str | None]] = []  # offset, reference, problem
    found += [(match.start(), match.group(0), path_problem(*match.groups())) for match in PATH.finditer(text)]
    found += [
        (match.start(), match.group(1), dotted_problem(match.group(1), in_code=False))
        for match in DOTTED.finditer(blocks)
        if match.group(1).split(".")[0] in ("accel_trainer", "at")  # a code block's variables are no module of ours
    ]
    found += [
        (start + match.start(), match.group(1), dotted_problem(match.group(1), in_code=True))
        for start, span in spans
        for match in DOTTED.finditer(span)
    ]
    found += [
        (match.start(), match.group(1), dotted_problem(match.group(1), in_code=False))
        for match in DOTTED.finditer(prose)
        if match.group(1).split(".")[0] in ("accel_trainer", "at", *our_modules())
    ]
    return [
        f"{shown}:{text.count(chr(10), 0, offset) + 1}: {reference} ({problem})"
        for offset, reference, problem in sorted((item for item in found if item[2]), key=lambda item: item[0])
    ]


# --- the tests ------------------------------------------------------------------------------------------------------


def test_the_readme_fits_on_a_page():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail into docs/"


def test_the_readme_links_to_files_that_exist():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if "://" not in target]
    assert local, "the README links into docs/"
    assert [target for target in local if not (REPO / target).exists()] == []


def test_every_name_of_our_code_in_the_docs_exists():
    problems = [problem for document in DOCUMENTS for problem in document_problems(document)]
    print(f"\nchecked {len(DOCUMENTS)} documents")
    if problems:
        pytest.fail("stale references (rules in tests/test_docs.py's docstring):\n" + "\n".join(problems), False)


@pytest.mark.parametrize(
    "text, stale",
    [
        ("`launch_fixes.forget_accelerate_state`", False),
        ("`launch_fixes.no_such_function`", True),
        ("`checkpoint_restore.step_hooks_silenced`", True),  # the module was renamed
        ("`torch.save` and `model.module`", False),
        ("see accel_trainer/checkpoint/save.py", False),
        ("see accel_trainer/checkpoint/gone.py", True),
        ("`test_step.py::test_no_such_test`", True),
        ("`at.train` and accel_trainer.config.train_config.TrainConfig.max_steps", False),
        ("`at.no_such_name`", True),
        ("`config.yaml` and `my_gpt.py`", False),
    ],
)
def test_the_reference_check_finds_a_stale_name(tmp_path, text, stale):
    document = tmp_path / "page.md"
    document.write_text(f"A line.\n{text}\n")
    problems = document_problems(document)
    assert bool(problems) == stale, problems
