"""The package as a user installs it: a wheel (not an editable install) carries the shipped recipes and layouts,
and from a folder outside the checkout its console script lists them, `cp` copies one, and `accelerate launch`
of the copied recipe file trains on the copied 2-process layout (`train ./file.py` on 1 process: test_shipped.py)."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ACCELERATE_LAUNCH, REPO, clean_env, free_port, run_command


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install` of the repository into its own folder (built as a wheel, never editable), and an empty
    working folder elsewhere; commands run there with only that install of accel_trainer importable first."""
    root = tmp_path_factory.mktemp("installed")
    target, elsewhere = root / "site", root / "elsewhere"
    elsewhere.mkdir()
    run_command(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
         "--target", target, REPO],
    )  # fmt: skip
    env = clean_env(PYTHONPATH=str(target))

    def command(*arguments, check: bool = True):
        return run_command([str(a) for a in arguments], env=env, cwd=elsewhere, check=check)

    return command, target, elsewhere


def test_a_wheel_installed_elsewhere_lists_copies_and_trains_its_recipes_and_layouts(installed):
    command, target, elsewhere = installed
    where = command(sys.executable, "-c", "import accel_trainer; print(accel_trainer.__file__)").stdout
    assert where.startswith(str(target))  # the wheel's copy, not the checkout's

    listed = command(target / "bin" / "accel-trainer", "list").stdout  # the wheel's console script
    assert "  gpt  " in listed and "  vae  " in listed and "  cpu_fsdp  " in listed
    assert f"{target}/accel_trainer/shipped_layouts/NAME.yaml" in listed

    command(sys.executable, "-m", "accel_trainer", "cp", "mlp", "my_mlp.py")
    command(sys.executable, "-m", "accel_trainer", "cp", "cpu_ddp", ".")
    run = elsewhere / "run"
    launched = command(*ACCELERATE_LAUNCH, "--config_file", "cpu_ddp.yaml", "--main_process_port", free_port(),
                       "my_mlp.py", "max_steps=3", f"output_dir={run}", "show_progress_bar=false",
                       "report=false")  # fmt: skip

    assert "2 process(es)" in launched.stdout  # the copied recipe file, launched on the copied layout
    assert "(no layout= named: a FILE.settings.yaml beside the accelerate config is read with layout=FILE)" in (
        launched.stdout
    )  # a plain accelerate launch: its workers cannot know the file, and say so
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 3 and (run / "final" / "model.safetensors").is_file()


def test_the_wheel_lists_every_package_of_the_source_tree():
    import tomllib

    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "accel_trainer").rglob("__init__.py")}
    assert set(listed) == found | {"accel_trainer.shipped_recipes", "accel_trainer.shipped_layouts"}
