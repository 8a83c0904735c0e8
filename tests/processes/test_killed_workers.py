"""Processes killed outright lose nothing.

- SIGKILL in the middle of a save: the previous checkpoint still verifies and `resume=auto` continues from it.
- A worker that dies under `accelerate launch --max_restarts 1` (torchrun's elastic agent, as under
  `torchrun --max_restarts 1`): the group restarts, resumes from the latest checkpoint and finishes with the
  uninterrupted run's parameters.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from accel_trainer.checkpoint import files
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    LAUNCH_TIMEOUT_S,
    REPO,
    TEST_OVERRIDES,
    WORKERS,
    assert_bitwise,
    dump_env,
    final_parameters,
    free_port,
    read_metrics,
    train_and_dump,
    wait_for,
)

pytestmark = pytest.mark.multiprocess


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (state T): a SIGSTOP is delivered after killpg returns, and
    a thread still running may publish the save between the check and the kill (seen once in CI)."""
    stats = [Path(f"/proc/{pid}/task/{task}/stat").read_text() for task in os.listdir(f"/proc/{pid}/task")]
    return all(stat.rpartition(")")[2].split()[0] in ("T", "t") for stat in stats)


def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    run = ["max_steps=1000", "save_every_steps=5", "keep_last=1", "log_every_steps=1", "eval_every_steps=0"]
    worker = subprocess.Popen(
        [str(BIN / "python"), str(WORKERS / "train_and_dump.py"), "vae_heavy", *run, f"output_dir={tmp_path}",
         *TEST_OVERRIDES],
        cwd=REPO, env=dump_env(tmp_path, 1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    killed_at: list[int] = []  # the step of a save stopped between writing its weights and publishing them

    def caught_mid_save() -> bool:
        assert worker.poll() is None, f"the training ended (exit {worker.returncode}) before a save was caught"
        for step in range(10, 1000, 5):
            if (files.temporary_folder(tmp_path, step) / "model.safetensors").exists():
                os.killpg(worker.pid, signal.SIGSTOP)  # frozen where it is: did it publish in between?
                wait_for(lambda: stopped(worker.pid), timeout_s=30)  # SIGSTOP lands later than killpg returns
                if files.temporary_folder(tmp_path, step).exists() and not files.final_folder(tmp_path, step).exists():
                    killed_at.append(step)
                    return True
                os.killpg(worker.pid, signal.SIGCONT)  # it had: catch a later save
        return False

    try:  # any save after the first: under load the poll may miss one save's window, never all of them
        wait_for(caught_mid_save, timeout_s=LAUNCH_TIMEOUT_S)
        os.killpg(worker.pid, signal.SIGKILL)
    finally:
        worker.wait(timeout=60)
    step = killed_at[0]
    assert not files.final_folder(tmp_path, step).exists()  # killed before it was published

    newest = files.newest_valid_checkpoint(tmp_path)
    assert newest is not None and newest.name == files.step_folder_name(step - 5)
    files.verify(newest)
    resumed = train_and_dump("cpu", tmp_path, "vae_heavy", *run, f"max_steps={step - 3}", world_size=1)  # resume=auto
    assert [r["step"] for r in resumed if "loss" in r][-2:] == [step - 4, step - 3]
    assert not files.temporary_folder(tmp_path, step).exists()  # the interrupted save was cleaned up


def test_a_worker_that_dies_is_restarted_elastically_and_ends_like_an_uninterrupted_run(tmp_path):
    # accelerate launch's multi-process launcher is torchrun's own `run`, in its process: one elastic agent and one
    # restart path for both launchers, so one of them is tested (a torchrun variant doubled the CI time)
    run = ["max_steps=30", "save_every_steps=5", "log_every_steps=5", "eval_every_steps=0", "sample_latent=false",
           "micro_batch_size=16"]  # fmt: skip
    crash = "crash_at_micro_batch=27"  # process 1 dies during step 14, after the step-10 checkpoint
    command = [*ACCELERATE_LAUNCH, "--config_file", REPO / "accelerate_configs/cpu_ddp.yaml", "--max_restarts", "1",
               "--main_process_port", str(free_port())]  # fmt: skip
    result = subprocess.run(
        [str(c) for c in command] + [str(WORKERS / "train_and_dump.py"), "vae_crash_once", *run, crash,
                                     f"output_dir={tmp_path / 'elastic'}", *TEST_OVERRIDES],
        cwd=REPO, env=dump_env(tmp_path / "elastic", 2), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming from" in result.stdout and "step_00000010" in result.stdout

    train_and_dump("cpu_ddp", tmp_path / "uninterrupted", "vae_crash_once", *run, world_size=2)
    assert_bitwise(final_parameters(tmp_path / "uninterrupted"), final_parameters(tmp_path / "elastic"))
    assert [r["step"] for r in read_metrics(tmp_path / "elastic") if "loss" in r][-1] == 30
