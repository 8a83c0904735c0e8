"""The same recipe and overrides run through every entry point: recipe file, Makefile, CLI, Python.

(torchrun and the Python API are exercised in test_multiprocess.py and test_vae.py.)
"""

from __future__ import annotations

import pytest

from conftest import BIN, REPO, TEST_OVERRIDES, accelerate_launch, free_port, read_metrics, run_command

pytestmark = pytest.mark.multiprocess
QUICK = ["max_steps=4", "log_every_steps=2", "eval_every_steps=0"]


def test_accelerate_launch_runs_a_recipe_file_on_the_cpu_layout(tmp_path):
    accelerate_launch("cpu", REPO / "recipes" / "vae.py", *QUICK, f"output_dir={tmp_path}")

    assert [r["world_size"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 1]
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_console_script_trains_a_registered_recipe(tmp_path):
    run_command([BIN / "accel-trainer", "train", "vae", *QUICK, f"output_dir={tmp_path}", *TEST_OVERRIDES])

    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [2, 4]


def test_makefile_layout_target_runs_two_processes_with_recipe_and_args(tmp_path):
    arguments = " ".join([*QUICK, f"output_dir={tmp_path}", *TEST_OVERRIDES])
    run_command(
        [
            "make",
            "--no-print-directory",
            "train-cpu-ddp",
            "RECIPE=vae",
            f"ARGS={arguments}",
            f"LAUNCH_FLAGS=--main_process_port {free_port()}",
        ]
    )

    assert [r["world_size"] for r in read_metrics(tmp_path) if "loss" in r] == [2, 2]
