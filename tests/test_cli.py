"""Specification of the command line: `accel-trainer list`, a recipe's `--help`, and one-line user errors."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys

import pytest
import yaml

from accel_trainer import ConfigError, cli, training
from accel_trainer.config.command_line import parse_command_line
from accel_trainer.registry import describe, get_recipe, registered_recipes
from conftest import WORKERS


def one_line_error(capsys) -> str:
    """The single stderr line of a failed command, checked to be a user error and not a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("accel-trainer: error: ")
    return lines[0]


def test_list_prints_each_recipe_with_its_one_line_description(capsys):
    cli.main(["list"])
    lines = capsys.readouterr().out.splitlines()
    vae_lines = [line for line in lines if line.split()[:1] == ["vae"]]
    assert len(vae_lines) == 1
    description = describe(get_recipe("vae"))
    assert description  # every recipe documents itself
    assert vae_lines[0].endswith(f"  {description}")


def test_a_recipes_help_prints_every_config_field_with_its_docstring(capsys):
    training.main("vae", ["--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"vae: {describe(get_recipe('vae'))}")
    assert "key=value" in out
    for field in dataclasses.fields(get_recipe("vae").Config):
        assert f"  {field.name}=" in out
    assert "Dimension of the Gaussian latent code." in out  # a recipe field's docstring
    assert "Number of optimizer steps to train for." in out  # a framework field's docstring


def test_train_help_without_a_recipe_lists_the_recipes_and_says_how_to_see_their_keys(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["train", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: accel-trainer train RECIPE [--config FILE.yaml] [--print-config] [key=value | --key")
    for name, recipe_cls in registered_recipes().items():
        assert any(line.split() and line.split()[0] == name and line.endswith(describe(recipe_cls))
                   for line in out.splitlines()), name  # fmt: skip
    assert "accel-trainer train RECIPE --help" in out


def test_train_help_through_the_accel_trainer_command_is_the_recipes_help(capsys):
    cli.main(["train", "vae", "--help"])
    assert "  latent_dim=" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("recipe", "arguments", "expected"),
    [
        ("nosuch", ["max_steps=3"], "unknown recipe 'nosuch'"),
        ("vae", ["max_stepz=3"], "did you mean 'max_steps'?"),
        ("vae", ["max_steps=three"], "max_steps='three': expected int"),
        ("vae", ["mixed_precision=fp32"], "mixed_precision='fp32'"),
        ("vae", ["max_steps"], "write key=value"),
        ("vae", ["--verbose"], "--verbose needs a value: --verbose VALUE, --verbose=VALUE or verbose=VALUE"),
        ("vae", ["--lr", "--max-steps", "3"], "--lr needs a value"),
        ("vae", ["--lr", "max_steps=3"], "--lr needs a value"),  # not lr='max_steps=3'
        ("vae", ["--config", "max_steps=3"], "--config needs a file"),
        ("vae", ["--print-config=true"], "--print-config takes no value"),
        ("vae", ["-v"], "unknown option '-v': write key=value, --key value or --key=value"),
        ("vae", ["--=3"], "'--=3' names no key"),
        ("vae", ["--config"], "--config needs a file"),
        ("vae", ["--max-stepz", "3"], "did you mean 'max_steps'?"),
        ("vae", ["max_steps=-5"], "max_steps=-5: must be at least 1"),
        ("vae", ["max_steps=0"], "max_steps=0: must be at least 1"),
        ("vae", ["warmup_steps=-1"], "warmup_steps=-1: must be at least 0"),
        ("vae", ["lr=nan"], "lr=nan: expected a finite number"),
        ("vae", ["min_lr_ratio=1.5"], "min_lr_ratio=1.5: must be at most 1"),
        ("vae", ["collective_timeout_s=0"], "collective_timeout_s=0.0: must be more than 0"),
        ("vae", ["save_every_steps=-1"], "save_every_steps=-1: must be at least 0"),
        ("vae", ["num_processes=2"], "processes are the launcher's, not a config key: accelerate launch"),
    ],
)
def test_a_user_error_exits_2_with_one_line_on_stderr(capsys, recipe, arguments, expected):
    with pytest.raises(SystemExit) as caught:
        training.main(recipe, arguments)
    assert caught.value.code == 2
    assert expected in one_line_error(capsys)


def test_argparse_habits_are_the_same_overrides_and_the_last_one_written_counts():
    line = parse_command_line(["--max-steps", "7", "--lr=0.02", "latent_dim=4", "lr=0.1", "--lr", "-0.5"])

    assert line.overrides == {"max_steps": "7", "lr": "-0.5", "latent_dim": "4"}
    assert line.config_file is None and not line.print_config
    line = parse_command_line(["--config", "base.yaml", "--print-config", "--config=other.yaml"])
    assert line.config_file == "other.yaml" and line.print_config and line.overrides == {}


def test_layout_is_not_a_config_value_and_the_words_after_a_double_dash_are_its_launchers():
    line = parse_command_line(["lr=0.1", "--layout", "cpu_ddp", "--", "--main_process_port", "29600", "lr=2"])

    assert line.overrides == {"lr": "0.1"} and line.layout == "cpu_ddp"
    assert line.launcher_options == ["--main_process_port", "29600", "lr=2"]
    with pytest.raises(ConfigError, match=r"launcher options after -- \(--main_process_port 1\) need a layout="):
        parse_command_line(["lr=0.1", "--", "--main_process_port", "1"])


def test_print_config_prints_yaml_that_config_reads_back_and_trains_nothing(capsys, tmp_path):
    command = ["--max-steps", "7", f"--output_dir={tmp_path / 'run'}", "mixed_precision=bf16", "--print-config"]
    with pytest.raises(SystemExit) as caught:
        training.main("vae", command)

    printed = capsys.readouterr().out
    assert caught.value.code == 0
    assert printed.startswith("# vae: what this command would train with (defaults < the command's overrides)")
    values = yaml.safe_load(printed)
    assert values["max_steps"] == 7 and values["latent_dim"] == 8  # the override, and the recipe's own default
    assert values["mixed_precision"] == "bf16" and values["tp_size"] == 1  # the layout settings too
    assert not (tmp_path / "run").exists()  # nothing trained, no folder made
    (tmp_path / "printed.yaml").write_text(printed)
    with pytest.raises(SystemExit):
        training.main("vae", ["--config", str(tmp_path / "printed.yaml"), "--print-config"])
    assert yaml.safe_load(capsys.readouterr().out) == values


@pytest.mark.parametrize("arguments", [["--help"], ["max_steps=-5"]])
def test_the_command_gives_the_callers_signal_handlers_back_however_it_ends(arguments, capsys):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}

    with contextlib.suppress(SystemExit):
        training.main("vae", arguments)

    assert {sig: signal.getsignal(sig) for sig in before} == before  # else a later run inherits a stale signal


def test_a_ctrl_c_while_the_command_starts_is_one_line_and_exit_130_not_an_import_traceback(monkeypatch, capsys):
    installed = {}
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.setdefault(signum, handler))
    monkeypatch.setattr(cli, "run_under_fast_allocator", lambda: None)
    monkeypatch.setattr(sys, "argv", ["accel-trainer", "train", "--help"])
    with contextlib.suppress(SystemExit):
        cli.main()  # as the process's command: the handler goes in before torch is imported

    assert installed[signal.SIGINT] is cli.interrupted_while_starting
    with pytest.raises(SystemExit) as stopped:
        cli.interrupted_while_starting(signal.SIGINT, None)
    assert stopped.value.code == 130
    assert capsys.readouterr().err.endswith("accel-trainer: interrupted while starting, before anything trained\n")


def test_an_unwritable_output_dir_exits_2_with_one_line_on_stderr(capsys, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")

    with pytest.raises(SystemExit) as caught:
        training.main("vae", [f"output_dir={tmp_path / 'a_file' / 'run'}", "max_steps=1"])

    assert caught.value.code == 2
    assert f"cannot write the run folder {tmp_path / 'a_file' / 'run'}: Not a directory" in one_line_error(capsys)


def test_warmup_beyond_max_steps_is_warned_about(tmp_path):
    import accel_trainer as at

    with pytest.warns(UserWarning, match="warmup_steps=50 is beyond max_steps=2"):
        at.train("vae", output_dir=str(tmp_path), max_steps=2, warmup_steps=50, show_progress_bar=False, report=False)


def test_a_missing_config_file_exits_2_with_one_line_on_stderr(capsys, tmp_path):
    with pytest.raises(SystemExit) as caught:
        training.main("vae", ["--config", str(tmp_path / "missing.yaml")])
    assert caught.value.code == 2
    assert "does not exist" in one_line_error(capsys)


@pytest.mark.parametrize("layout", [[], ["layout=cpu_ddp"]], ids=["here", "2 processes"])
def test_the_installed_command_reports_a_typo_in_one_line_and_exits_2(layout, tmp_path):
    """On a layout of several processes too: said once, before they start (each would say it)."""
    result = subprocess.run(
        [sys.executable, "-m", "accel_trainer", "train", "vae", *layout, "max_stepz=3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "accel-trainer: error: unknown config key 'max_stepz' in overrides; did you mean 'max_steps'?"
    ]
    assert not list(tmp_path.iterdir())  # a rejected run writes nothing


@pytest.mark.parametrize("layout", ["layout=cpu_ddp", "layout=cpu_fsdp_tp"], ids=["DDP", "FSDP x TP: 2 of 4"])
def test_batch_sizes_that_do_not_split_over_a_layout_s_data_parallel_ranks_are_said_once_before_any_process_starts(
    layout, tmp_path
):
    result = subprocess.run(
        [sys.executable, "-m", "accel_trainer", "train", "mlp", layout, "global_batch_size=30", "micro_batch_size=4"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "accel-trainer: error: global_batch_size=30 is not a multiple of micro_batch_size=4 x 2 data-parallel rank(s)"
        " = 8; pick a global_batch_size divisible by 8 (24 or 32) or a smaller micro_batch_size that divides it: 3"
    ]
    assert not list(tmp_path.iterdir())


def test_a_refusal_every_process_of_a_started_layout_makes_is_said_once_and_leaves_no_run_folder(tmp_path):
    """Made by the processes themselves, after the run folder and its header files were written: the stream of
    one shard cannot be split over 2 processes."""
    recipe = WORKERS / "recipes" / "sources.py"
    result = subprocess.run(
        [sys.executable, "-m", "accel_trainer", "train", str(recipe), "layout=cpu_ddp", "source=hf_generator",
         "stream_split=shards", f"output_dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "accel-trainer: error: stream_split=shards: the training stream has 1 shard(s), so 1 reader(s) (their greatest"
        " common divisor with global_batch_size=16), which do not split over 2 data-parallel process(es); give it a"
        " shard count whose greatest common divisor with global_batch_size is a multiple of 2 (files, or"
        " to_iterable_dataset(num_shards=...)), or set stream_split=auto: each process then reads the readers its"
        " share of a step spans (neighbours share an edge one), and one reader is read whole"
    ]
    assert not (tmp_path / "run").exists()  # its config.yaml, run_info.json, ... went with it


HEAVY_MODULES = ("torch", "accelerate", "datasets", "transformers")


@pytest.mark.parametrize("arguments", [["--help"], ["report", "--help"]])
def test_help_that_needs_no_recipe_imports_no_torch_accelerate_or_datasets(arguments):
    # Checked as imports, not as seconds: `accel-trainer --help` took 3.3 s when it imported torch.
    script = (
        "import sys\nfrom accel_trainer import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        f"print('heavy:', [m for m in {HEAVY_MODULES!r} if m in sys.modules], file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", script, *arguments], capture_output=True, text=True, timeout=120)
    assert "usage: accel-trainer" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "heavy: []"


def test_every_public_name_of_the_package_is_found_where_it_is_defined():
    import accel_trainer as at

    assert sorted(at.__all__) == sorted(at._HOMES)
    for name in at.__all__:
        assert getattr(at, name).__module__ == f"accel_trainer.{at._HOMES[name]}"


@pytest.mark.parametrize(
    ("arguments", "status"),  # 1 as in the Python docs' recipe for SIGPIPE; argparse's own --help says 0
    [(["--help"], 0), (["list"], 1), (["train", "vae", "--help"], 1)],
)
def test_a_closed_stdout_ends_a_command_quietly_like_a_unix_tool(arguments, status):
    # `accel-trainer train vae --help | head` once ended in a BrokenPipeError traceback. A pipe whose reader is
    # already gone is what `head` leaves once it has read its lines.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "accel_trainer", *arguments], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == status


def test_a_submodule_is_an_attribute_of_the_package_without_importing_it_first():
    # as when the package imported everything eagerly: test workers call at.registry.discover_recipes()
    script = "import accel_trainer as at\nprint(at.registry.discover_recipes.__name__, at.config.__name__)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["discover_recipes", "accel_trainer.config"], result.stderr
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        import accel_trainer

        accel_trainer.no_such_thing  # noqa: B018 - the lookup is the test
