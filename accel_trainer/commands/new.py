"""`accel-trainer new NAME`: a new recipe file, ready to run, from the template recipes/mlp.py is made of.

The template (templates/recipe.py.template) is the shortest complete recipe: a config with one field of its own,
model, datasets, loss, eval metrics and a `__main__` line. `new` fills in the name and a description that
names the new recipe (the template's own, copied, would show in `accel-trainer list` as a second mlp), refuses
a name that is not a Python identifier or a file that exists (one-line errors: nothing is overwritten), and says
how to run what it wrote.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

from accel_trainer.errors import ConfigError

TEMPLATE = Path(__file__).parents[1] / "templates" / "recipe.py.template"


def render(name: str, description: str | None = None, folder: str = "recipes") -> str:
    """The template with `name` as the recipe's registered name and file, and its CamelCase as the class.

    Args:
        name: the recipe's registered name.
        folder: where the file is written, for the commands its docstring shows.
        description: the class docstring's first line, which `accel-trainer list` shows; by default one that
            names the recipe, so that `accel-trainer list` does not show mlp's line twice.
    """
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ConfigError(
            f"recipe name {name!r}: use lower-case letters, digits and underscores, starting with a letter"
        )
    class_name = "".join(part.capitalize() for part in name.split("_"))
    if description is None:
        description = f"MLP on 8x8 digits, from `accel-trainer new {name}`: say here what it trains."
    fields = {"name": name, "Class": class_name, "description": description, "folder": folder}
    return Template(TEMPLATE.read_text()).substitute(fields)


def write_new_recipe(name: str, folder: str | Path = "recipes") -> Path:
    """Write `<folder>/<name>.py` from the template; returns its path."""
    path = Path(folder) / f"{name}.py"
    text = render(name, folder=Path(folder).as_posix())
    if path.exists():
        raise ConfigError(f"{path} exists: choose another name, or another folder with --folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
