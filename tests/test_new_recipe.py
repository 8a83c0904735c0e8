"""`accel-trainer new NAME` writes a recipe that runs; recipes/mlp.py is that template, and reaches its bar."""

from __future__ import annotations

import ast
import subprocess

import pytest

from accel_trainer import cli
from accel_trainer.commands.new import render
from accel_trainer.registry import describe, get_recipe
from conftest import BIN, REPO, read_metrics


def test_recipes_mlp_is_the_template_new_writes():
    assert (REPO / "recipes" / "mlp.py").read_text() == render("mlp", describe(get_recipe("mlp")))


def test_a_new_recipe_describes_itself_so_list_does_not_show_the_templates_line_twice(tmp_path):
    cli.main(["new", "my_digits", "--folder", str(tmp_path)])
    module = ast.parse((tmp_path / "my_digits.py").read_text())
    recipe_class = next(node for node in module.body if isinstance(node, ast.ClassDef) and node.name == "MyDigits")
    description = (ast.get_docstring(recipe_class) or "").splitlines()[0]
    assert description != describe(get_recipe("mlp"))
    assert "my_digits" in description


def test_new_writes_a_recipe_that_trains_to_the_templates_accuracy(tmp_path, capsys):
    cli.main(["new", "my_digits", "--folder", str(tmp_path)])
    path = tmp_path / "my_digits.py"
    said = capsys.readouterr().out
    assert f"wrote {path}" in said and f"accel-trainer train {path}" in said  # a name alone is not found elsewhere
    assert f"python {tmp_path.as_posix()}/my_digits.py" in path.read_text()  # its docstring's commands name it
    assert 'register_recipe("my_digits")' in path.read_text() and "class MyDigits(at.Recipe)" in path.read_text()
    subprocess.run([BIN / "python", path, "max_steps=300", f"output_dir={tmp_path / 'run'}", "show_progress_bar=false"],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    final = [r for r in read_metrics(tmp_path / "run") if "eval/accuracy" in r][-1]
    assert final["step"] == 300 and final["eval/accuracy"] >= 0.95  # the template's stated bar is at 600 steps


@pytest.mark.parametrize(("name", "message"), [("My-Recipe", "use lower-case letters"), ("2fast", "starting with")])
def test_a_name_that_is_not_an_identifier_is_a_one_line_error(tmp_path, capsys, name, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["new", name, "--folder", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_new_never_overwrites_a_file(tmp_path, capsys):
    (tmp_path / "taken.py").write_text("# mine\n")
    with pytest.raises(SystemExit):
        cli.main(["new", "taken", "--folder", str(tmp_path)])
    assert "exists: choose another name" in capsys.readouterr().err
    assert (tmp_path / "taken.py").read_text() == "# mine\n"
