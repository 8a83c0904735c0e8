"""The recipes and layouts accel-trainer ships, found from a checkout or from an installed package, and copied out.

In a source checkout they are the repository's `recipes/` and `accelerate_configs/`; an installed wheel carries
the same files as package data (`accel_trainer/shipped_recipes/`, `accel_trainer/shipped_layouts/`: see
pyproject.toml), so `accel-trainer list`, `accel-trainer cp` and a layout named by its name work from any folder.

`copy_shipped` is `accel-trainer cp NAME|LAYOUT DEST`: a recipe's file under a new name (`my_gpt.py`, or
`my_<name>.py` in a folder; the registered name becomes the file's, so the copy and the original can both be
trained), or a layout's accelerate config with its settings companion. It never overwrites.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from accel_trainer.config.layout import SETTINGS_SUFFIX, settings_file_of
from accel_trainer.errors import ConfigError

_PACKAGE = Path(__file__).resolve().parents[1]  # accel_trainer/
_CHECKOUT = _PACKAGE.parent


def _shipped_folder(checkout_name: str, packaged_name: str) -> Path:
    checkout = _CHECKOUT / checkout_name
    if checkout.is_dir() and (_CHECKOUT / "pyproject.toml").is_file():
        return checkout
    return _PACKAGE / packaged_name


def recipes_folder() -> Path:
    """The shipped recipe files' folder."""
    return _shipped_folder("recipes", "shipped_recipes")


def layouts_folder() -> Path:
    """The shipped accelerate configs' folder (each layout's `<name>.yaml`, and `<name>.settings.yaml` beside some)."""
    return _shipped_folder("accelerate_configs", "shipped_layouts")


def layouts() -> dict[str, Path]:
    """Each shipped layout's name and accelerate config file."""
    files = sorted(layouts_folder().glob("*.yaml"))
    return {path.stem: path for path in files if not path.name.endswith(SETTINGS_SUFFIX)}


def describe_layout(path: Path, width: int = 100) -> str:
    """The first sentence of a layout file's opening comment, without its `Layout:` lead, at most `width` long."""
    lines: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or (lines and line.startswith("#  ")):  # the comment's end, or an example
            break
        lines.append(line.lstrip("# "))
    text = " ".join(lines).removeprefix("Layout:").strip()
    sentence = text.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[: sentence.rfind(" ", 0, width - 3)] + "..."


def recipe_files() -> dict[str, Path]:
    """Each shipped recipe's registered name and file (a recipe file is named after the recipe it registers)."""
    return {path.stem: path for path in sorted(recipes_folder().glob("*.py")) if not path.name.startswith("_")}


def find_layout(name_or_file: str) -> Path:
    """A layout's accelerate config: a file that exists, or a shipped layout's name (`cpu_fsdp`, `cpu_fsdp.yaml`).

    Raises:
        ConfigError: neither; the message lists the shipped names.
    """
    path = Path(name_or_file)
    if path.is_file():
        return path
    shipped = layouts().get(path.name.removesuffix(".yaml")) if path.parent == Path(".") else None
    if shipped is None:
        near = difflib.get_close_matches(path.name.removesuffix(".yaml"), layouts(), n=2)
        hint = f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""
        raise ConfigError(
            f"layout {name_or_file!r} is neither a file nor a shipped layout{hint}; shipped: {', '.join(layouts())}"
        )
    return shipped


def copy_shipped(name: str, destination: str | Path) -> list[Path]:
    """Copy a shipped recipe (by its name) or layout to `destination` (a file name, or an existing folder);
    returns what was written.

    Raises:
        ConfigError: an unknown name, a recipe destination that is not a .py file name, or a file that exists.
    """
    destination = Path(destination)
    recipes = recipe_files()
    if name in recipes:
        target = destination / f"my_{name}.py" if destination.is_dir() else destination
        if target.suffix != ".py" or not re.fullmatch(r"[a-z][a-z0-9_]*", target.stem):
            raise ConfigError(f"{target}: a recipe copy is a .py file named in lower-case letters, digits and _")
        if target.stem in recipes:  # two recipe files of one name: the registry would refuse both
            raise ConfigError(f"{target.stem} is a shipped recipe's name: give the copy its own, e.g. my_{name}.py")
        recipe_file = recipes[name]
        text = recipe_file.read_text()
        if target.stem != name:  # registered under the copy's name, so both recipes stay trainable
            text = re.sub(rf"""(register_recipe|main)\((["']){name}\2\)""", rf"\1(\g<2>{target.stem}\2)", text)
        return _write_all({target: text})
    layout = layouts().get(name.removesuffix(".yaml"))
    if layout is None:
        raise ConfigError(
            f"{name!r} is neither a shipped recipe ({', '.join(recipes)}) nor a shipped layout ({', '.join(layouts())})"
        )
    target = destination / layout.name if destination.is_dir() else destination
    if target.suffix != ".yaml":
        raise ConfigError(f"{target}: a layout copy is a .yaml file")
    files = {target: layout.read_text()}
    companion = settings_file_of(layout)
    if companion.is_file():  # the settings travel with the config they sit beside
        files[settings_file_of(target)] = companion.read_text()
    return _write_all(files)


def _write_all(files: dict[Path, str]) -> list[Path]:
    """Write each file, having checked first that none exists (a refused copy leaves nothing half done)."""
    for target in files:
        if target.exists():
            raise ConfigError(f"{target} exists: choose another name (nothing was copied over it)")
    for target, text in files.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return list(files)
