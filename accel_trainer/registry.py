"""Recipe registry: names to recipe classes, filled three ways.

1. `@register_recipe("name")` on a `Recipe` subclass, in any module or script.
2. The shipped recipe files (contract/shipped.py finds them in a checkout or an installed package) and those in
   `./recipes` are imported on demand, which runs their decorators; `train ./file.py` imports that file.
3. Installed packages declare an entry point in the group `accel_trainer.recipes` whose value is a module
   (registering on import) or a `Recipe` class (registered under the entry point's name).

A name registered twice by different classes is an error, while the same class seen again (a script run as
`__main__` and also found in `recipes/`) is not. An unknown name lists the known ones.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from accel_trainer.contract.shipped import recipes_folder
from accel_trainer.errors import RecipeError
from accel_trainer.recipe import Recipe

ENTRY_POINT_GROUP = "accel_trainer.recipes"

_recipes: dict[str, type[Recipe]] = {}
_discovered = False

R = TypeVar("R", bound=type[Recipe])


def register_recipe(name: str) -> Callable[[R], R]:
    """Class decorator that registers a `Recipe` subclass under `name`."""

    def decorate(recipe_cls: R) -> R:
        add_recipe(name, recipe_cls)
        return recipe_cls

    return decorate


def add_recipe(name: str, recipe_cls: type[Recipe]) -> None:
    """Register `recipe_cls` under `name`; the function form of `register_recipe`."""
    if not (isinstance(recipe_cls, type) and issubclass(recipe_cls, Recipe)):
        raise RecipeError(f"recipe {name!r} must be a subclass of accel_trainer.Recipe, got {recipe_cls!r}")
    existing = _recipes.get(name)
    if existing is not None and _identity(existing) != _identity(recipe_cls):
        raise RecipeError(
            f"recipe name {name!r} is registered twice: by {_identity(existing)} and by {_identity(recipe_cls)};"
            " rename one of them"
        )
    _recipes[name] = recipe_cls


_in_discovery: list[dict[str, Path]] = []
"""The recipe files of the folders being discovered, by name (discover_recipes): a file may ask for another."""


def get_recipe(name: str) -> type[Recipe]:
    """Look a recipe up by name, discovering folders and entry points if it is not registered yet. While folders
    are being discovered (a recipe file that builds on another, dpo.py on hf_finetune.py, imported first), the file
    of that name among them, imported now."""
    if name not in _recipes:
        discover_recipes()
    if name not in _recipes and _in_discovery and name in _in_discovery[-1]:
        _import_file(_in_discovery[-1][name])
    if name not in _recipes:
        known = sorted(_recipes)
        hint = difflib.get_close_matches(name, known, n=1)
        suggestion = f"did you mean {hint[0]!r}? " if hint else ""
        raise RecipeError(
            f"unknown recipe {name!r}; {suggestion}known recipes: {', '.join(known) or 'none'}"
            " (see `accel-trainer list`; a recipe file trains as `accel-trainer train ./file.py key=value ...`)"
        )
    return _recipes[name]


def recipe_name_of(name_or_file: str) -> str:
    """A recipe's name, or the name of the one recipe a `.py` file registers (`train ./my_gpt.py`), which imports it
    (the modules beside the file import too).

    Raises:
        RecipeError: the file does not exist, or registers no recipe or several.
    """
    if not name_or_file.endswith(".py"):
        return name_or_file
    path = Path(name_or_file).resolve()
    if not path.is_file():
        raise RecipeError(f"recipe file {name_or_file} does not exist")
    if str(path.parent) not in sys.path:  # its own modules beside it import, as under `python file.py`; appended,
        sys.path.append(str(path.parent))  # so a file named like an installed module never shadows it
    _import_file(path)
    names = [name for name, cls in _recipes.items() if _defined_in(cls, path)]
    if len(names) != 1:
        found = f"registers {', '.join(names)}: train one by name" if names else "registers no recipe"
        raise RecipeError(f'{name_or_file} {found} (@at.register_recipe("name") on a Recipe class)')
    return names[0]


def _defined_in(recipe_cls: type[Recipe], path: Path) -> bool:
    module_file = getattr(sys.modules.get(recipe_cls.__module__), "__file__", None)
    return module_file is not None and Path(module_file).resolve() == path


def registered_recipes() -> dict[str, type[Recipe]]:
    """Every recipe, after discovery, sorted by name."""
    discover_recipes()
    return dict(sorted(_recipes.items()))


def describe(recipe_cls: type[Recipe]) -> str:
    """The first line of a recipe's docstring, used by `accel-trainer list`."""
    # `__doc__`, not `inspect.getdoc`: getdoc falls back to the base class, so an undocumented recipe would be
    # listed with Recipe's own docstring.
    doc = inspect.cleandoc(recipe_cls.__doc__ or "")
    return doc.splitlines()[0] if doc else ""


def discover_recipes(folders: list[Path] | None = None) -> None:
    """Import the recipe folders and load entry points, once per process unless folders are given."""
    global _discovered
    if folders is None:
        if _discovered:
            return
        _discovered = True
        folders = _default_folders()
    files = [path for folder in folders for path in sorted(Path(folder).glob("*.py")) if not path.name.startswith("_")]
    by_stem: dict[str, Path] = {}
    for path in files:
        other = by_stem.setdefault(path.stem, path)
        # the same file twice (an installed package's shipped copy of the checkout's ./recipes file) is one recipe
        if other.resolve() != path.resolve() and other.read_bytes() != path.read_bytes():
            raise RecipeError(
                f"recipe files {other} and {path} have the same name: which one is meant is unclear, so neither"
                " is guessed; rename one of them"
            )
    _in_discovery.append(by_stem)
    try:
        for path in by_stem.values():
            _import_file(path)
    finally:
        _in_discovery.pop()
    _load_entry_points()


def _default_folders() -> list[Path]:
    folders = [recipes_folder(), Path.cwd() / "recipes"]
    unique: list[Path] = []
    for folder in folders:
        if folder.is_dir() and folder.resolve() not in [f.resolve() for f in unique]:
            unique.append(folder)
    return unique


def _import_file(path: Path) -> None:
    resolved = path.resolve()
    for module in list(sys.modules.values()):
        module_file = getattr(module, "__file__", None)
        # The file name first, as a string: resolving the paths of the thousands of loaded modules (torch's) took
        # seconds per recipe folder.
        if module_file and os.path.basename(module_file) == path.name and Path(module_file).resolve() == resolved:
            return  # already imported, e.g. the script being run; its decorators have run
    # Keyed by the full path: a module of the same stem elsewhere must never replace this one's classes.
    module_name = f"accel_trainer_recipes.{path.stem}_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except RecipeError:
        raise
    except Exception as error:
        del sys.modules[module_name]
        raise RecipeError(f"recipe file {path} failed to import: {type(error).__name__}: {error}") from error


def _load_entry_points() -> None:
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry_point.load()
        except Exception as error:
            raise RecipeError(
                f"entry point {entry_point.name!r} ({entry_point.value}) of group {ENTRY_POINT_GROUP!r}"
                f" failed to load: {type(error).__name__}: {error}"
            ) from error
        if isinstance(loaded, type) and issubclass(loaded, Recipe):
            if loaded not in _recipes.values():
                add_recipe(entry_point.name, loaded)
        elif not isinstance(loaded, types.ModuleType):
            raise RecipeError(
                f"entry point {entry_point.name!r} ({entry_point.value}) of group {ENTRY_POINT_GROUP!r} must name"
                f" a module or a Recipe subclass, not {loaded!r}"
            )


def _identity(recipe_cls: type) -> str:
    """Where a recipe class was defined: the same identity may register again (a notebook cell run twice
    replaces its recipe), another one may not claim the same name."""
    try:
        source = Path(inspect.getsourcefile(recipe_cls) or "").resolve()
    except (TypeError, OSError):  # a class of a notebook cell or `python -c`: no file (3.13 raises OSError)
        source = Path(recipe_cls.__module__)
    return f"{recipe_cls.__qualname__} in {source}"
