"""The same recipe and overrides run through every entry point. Here the Makefile; elsewhere: `accelerate launch
recipe.py` and the console script from an installed wheel (test_installed_package.py), `torchrun recipe.py` and
`accel-trainer train NAME layout=` (tests/layouts/test_layout_anywhere.py), the Python API (test_vae.py,
test_python_entry.py), `accelerate launch -m accel_trainer train` (the layouts' launches in conftest).
"""

from __future__ import annotations

import pytest

from conftest import TEST_OVERRIDES, free_port, read_metrics, run_command

pytestmark = pytest.mark.multiprocess
QUICK = ["max_steps=4", "log_every_steps=2", "eval_every_steps=0"]


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
