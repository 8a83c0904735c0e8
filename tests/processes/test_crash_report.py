"""A bug in recipe code is shown as the recipe's own frames and the exception, once per run.

Not 40 lines of the loop, accelerate and torch, and not once per rank: process 0 prints the report, the
others one line each. ACCEL_TRAINER_FULL_TRACEBACK=1 shows the whole traceback.
"""

from __future__ import annotations

import subprocess

import pytest

from conftest import BIN, WORKERS, accelerate_launch, clean_env

SCRIPT = WORKERS / "crashing_recipe.py"
RUN = ["max_steps=2", "eval_every_steps=0", "warmup_steps=0"]


def test_a_crash_in_recipe_code_shows_only_the_recipes_frames(tmp_path):
    result = subprocess.run([str(BIN / "python"), str(SCRIPT), *RUN, f"output_dir={tmp_path}",
                             "show_progress_bar=false"], env=clean_env(), capture_output=True, text=True,
                            timeout=120)  # fmt: skip

    assert result.returncode == 1
    assert result.stderr.startswith("accel-trainer: error in recipe code, in compute_loss")
    assert 'crashing_recipe.py", line 16, in compute_loss' in result.stderr
    assert result.stderr.rstrip().endswith("KeyError: 'no_such_column'")
    assert "accel_trainer" not in result.stderr.replace("accel-trainer:", "") and "site-packages" not in result.stderr


def test_the_full_traceback_is_one_variable_away(tmp_path):
    result = subprocess.run([str(BIN / "python"), str(SCRIPT), *RUN, f"output_dir={tmp_path}"],
                            env=clean_env(ACCEL_TRAINER_FULL_TRACEBACK="1"), capture_output=True, text=True,
                            timeout=120)  # fmt: skip

    assert "Traceback (most recent call last)" in result.stderr and "accel_trainer/engine/loop.py" in result.stderr


@pytest.mark.multiprocess
def test_on_two_processes_the_report_appears_once(tmp_path):
    result = accelerate_launch("cpu_ddp", SCRIPT, *RUN, f"output_dir={tmp_path}", check=False)

    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("error in recipe code, in compute_loss") == 1
    assert output.count("accel-trainer: rank 1: KeyError: 'no_such_column'") == 1
