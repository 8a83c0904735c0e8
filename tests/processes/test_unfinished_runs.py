"""A run that did not complete is never restarted silently from step 0.

- Without `output_dir`, the same command continues a run that was killed (SIGKILL: no handler runs), not
  only one that was preempted: the run's marker is written when it starts and removed when it completes.
- The same command started while the first still runs gets a folder of its own (the marker is locked).
- A run asked to resume a folder that holds a run but no complete checkpoint says it starts at step 0.
"""

from __future__ import annotations

import shutil
import signal
import subprocess

import pytest

import accel_trainer as at
from accel_trainer.checkpoint import files, run_folder
from accel_trainer.config.train_config import resolve_config
from accel_trainer.errors import ConfigError
from conftest import (
    BIN,
    LAUNCH_TIMEOUT_S,
    SIGNALLED,
    SLOW_STEP,
    TEST_OVERRIDES,
    WORKERS,
    clean_env,
    logged_steps,
    read_metrics,
    wait_for,
)


def test_a_killed_run_without_output_dir_is_continued_by_the_same_command(tmp_path):
    command = [str(BIN / "python"), str(WORKERS / "signalled_run.py"), "mlp_slow", *SIGNALLED, *TEST_OVERRIDES]
    killed = subprocess.Popen(command, cwd=tmp_path, env=clean_env(**SLOW_STEP), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(lambda: list(tmp_path.glob("outputs/mlp_slow/2*/checkpoints/step_00000010")))
        [run_dir] = tmp_path.glob("outputs/mlp_slow/2*")
        wait_for(lambda: logged_steps(run_dir) >= 12)
        killed.send_signal(signal.SIGKILL)
    finally:
        killed.wait(timeout=60)

    rerun = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                           timeout=LAUNCH_TIMEOUT_S, check=True)  # fmt: skip

    assert f"continuing the unfinished run in {run_dir.relative_to(tmp_path)}" in rerun.stdout, rerun.stdout
    assert "step_00000010 at step 10" in rerun.stdout, rerun.stdout
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, 31))
    assert list(tmp_path.glob("outputs/mlp_slow/2*")) == [run_dir]
    assert not list((tmp_path / "outputs" / "mlp_slow" / ".preempted").glob("*"))  # completed: marker gone


def test_the_same_command_started_while_it_still_runs_gets_a_folder_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config(at.get_recipe("mlp").Config)
    running = run_folder.choose("mlp", cfg)
    try:
        started_meanwhile = run_folder.choose("mlp", cfg)
        run_folder.release("mlp", cfg, started_meanwhile, completed=False)
    finally:
        run_folder.release("mlp", cfg, running, completed=False)  # killed, say

    assert started_meanwhile != running
    assert run_folder.choose("mlp", cfg) == running  # once it no longer runs, its command continues it
    run_folder.release("mlp", cfg, running, completed=True)


def test_a_run_asked_to_resume_a_folder_without_a_complete_checkpoint_says_it_starts_at_step_0(tmp_path, capsys):
    settings = dict(output_dir=str(tmp_path), max_steps=2, eval_every_steps=0, show_progress_bar=False, report=False)
    at.train("mlp", **settings)
    shutil.rmtree(files.checkpoints_dir(tmp_path))  # as if killed before its first save
    capsys.readouterr()

    at.train("mlp", **settings)

    assert f"accel-trainer: no complete checkpoint in {tmp_path}: starting at step 0" in capsys.readouterr().out


def test_a_run_refused_before_training_leaves_no_folder_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    with pytest.raises(ConfigError, match="micro_batch_size=7"):
        at.train("mlp", micro_batch_size=7, max_steps=1, show_progress_bar=False, report=False)

    assert not (tmp_path / "outputs").exists()
