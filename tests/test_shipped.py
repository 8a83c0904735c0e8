"""`accel-trainer list`, `cp` and `train ./file.py`: the shipped recipes and layouts, found and copied from any
folder (tests/processes/test_installed_package.py does it from an installed wheel)."""

from __future__ import annotations

import pytest

import accel_trainer as at
from accel_trainer import ConfigError, cli
from accel_trainer.contract.shipped import describe_layout, find_layout, layouts, recipe_files
from conftest import REPO, assert_one_line_error, exit_status, read_metrics


def test_list_shows_the_recipes_then_the_layouts_each_with_its_first_sentence(capsys):
    cli.main(["list"])
    out = capsys.readouterr().out

    assert out.index("  gpt ") < out.index("\nlayouts (") < out.index("  cpu_fsdp ")
    assert "  cpu_ddp            2 processes on one machine's CPU, DDP over gloo (no GPU needed)\n" in out
    configs = (REPO / "accelerate_configs").glob("*.yaml")
    assert set(layouts()) == {path.stem for path in configs if not path.name.endswith(".settings.yaml")}


def test_a_long_layout_description_is_cut_at_a_word():
    text = describe_layout(layouts()["cpu_pp_fsdp"], width=60)
    assert len(text) <= 60 and text.endswith("...") and text.startswith("4 processes on one machine's CPU")


def test_a_copied_recipe_registers_under_its_file_name_and_trains_beside_the_original(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_status(cli.main, ["cp", "mlp", "my_mlp.py"]) == 0
    assert "train it with: accel-trainer train my_mlp.py" in capsys.readouterr().out

    text = (tmp_path / "my_mlp.py").read_text()
    assert '@at.register_recipe("my_mlp")' in text and 'at.main("my_mlp")' in text and '"mlp"' not in text
    at.train("./my_mlp.py", max_steps=2, output_dir=str(tmp_path / "run"), show_progress_bar=False, report=False)
    assert max(r["step"] for r in read_metrics(tmp_path / "run")) == 2
    assert at.get_recipe("my_mlp") is not at.get_recipe("mlp")


def test_a_copied_layout_brings_its_settings_file(tmp_path, capsys):
    assert exit_status(cli.main, ["cp", "cpu_tp", str(tmp_path)]) == 0

    assert (tmp_path / "cpu_tp.settings.yaml").read_text() == (
        REPO / "accelerate_configs" / "cpu_tp.settings.yaml"
    ).read_text()
    assert "launch with: accelerate launch --config_file" in capsys.readouterr().out
    assert find_layout("cpu_tp") == REPO / "accelerate_configs" / "cpu_tp.yaml"


def test_a_mistyped_layout_name_gets_the_nearest_shipped_ones():
    with pytest.raises(ConfigError, match=r"layout 'cpu_dpp' is neither .* \(did you mean 'cpu_pp' or 'cpu_ddp'\?\)"):
        find_layout("cpu_dpp")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["cp", "mlp", "{tmp}/taken.py"], "taken.py exists: choose another name (nothing was copied over it)"),
        (["cp", "mlp", "{tmp}/vae.py"], "vae is a shipped recipe's name: give the copy its own, e.g. my_mlp.py"),
        (["cp", "mlp", "{tmp}/My-Mlp.py"], "a recipe copy is a .py file named in lower-case letters, digits and _"),
        (["cp", "cpu_tp", "{tmp}/taken.py"], "a layout copy is a .yaml file"),
        (["cp", "gtp", "{tmp}"], "'gtp' is neither a shipped recipe (dpo, gan, gpt,"),
        (["train", "{tmp}/missing.py"], "missing.py does not exist"),
        (["train", "{tmp}/taken.py"], "taken.py registers no recipe"),
    ],
)
def test_what_cannot_be_copied_or_trained_is_a_one_line_error(tmp_path, capsys, arguments, message):
    (tmp_path / "taken.py").write_text("x = 1\n")
    status = exit_status(cli.main, [a.format(tmp=tmp_path) for a in arguments])

    assert_one_line_error(status, capsys.readouterr().err, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.py"]


def test_every_shipped_recipe_file_registers_the_recipe_it_is_named_after():
    assert set(recipe_files()) <= set(at.registered_recipes())
