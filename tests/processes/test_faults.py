"""Faults beyond kill -9: a save that fails midway stops the run in one line and loses nothing.

A file-size limit (`ulimit -f`, so writes fail with EFBIG, as on a full disk or a quota) makes the save of
step 6 fail on 1 process and under 2-process FSDP (whose sharded save is collective): every process stops
with one line naming the checkpoints folder and the cause, no temporary folder is left for `resume=auto`
to trip on, the checkpoint of step 4 still verifies, and the same run without the limit continues from it
to the end. A checkpoints folder that became read-only (a read-only bind mount when the tests run as root,
whom permission bits do not stop) fails the same way. The failing run is a launch of its own (its exit and
its lines are the property); the runs before and after it are scenarios of the layout's launch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accel_trainer.checkpoint import files
from conftest import (
    ACCELERATE_LAUNCH,
    REPO,
    TEST_OVERRIDES,
    WORKERS,
    clean_env,
    free_port,
    read_metrics,
    run_command,
    train_and_dump,
)

RUN = ["save_every_steps=2", "keep_last=0", "warmup_steps=0", "eval_every_steps=0", "log_every_steps=1",
       "sample_latent=false"]  # fmt: skip
LIMIT_KB = 64  # the VAE's model.safetensors has 685 kB; metrics.jsonl and the small files stay far below


def launch(layout: str, out, *overrides: str, limit_kb: int | None = None, read_only: Path | None = None):
    """The failing run: a launch of its own, under a file-size limit or with the checkpoints folder read-only. The
    runs before and after it are scenarios of the layout's launch (the run folder is what they share)."""
    command = [*ACCELERATE_LAUNCH, "--config_file", REPO / "accelerate_configs" / f"{layout}.yaml",
               "--main_process_port", str(free_port()), WORKERS / "run_recipe.py", "vae", f"output_dir={out}",
               *RUN, *overrides, *TEST_OVERRIDES]  # fmt: skip
    if limit_kb is not None:
        command = ["bash", "-c", f'ulimit -f {limit_kb}; exec "$@"', "bash", *command]
    if read_only is not None:
        command = read_only_for(read_only, command)
    return run_command(command, env=clean_env(), check=False)


def read_only_for(folder: Path, command: list) -> list:
    """`command` seeing `folder` read-only: a read-only bind mount in a private mount namespace for root (whom
    permission bits do not stop), the folder's write bits taken away for anyone else (the caller restores them)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return command
    remount = f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && exec "$@"'
    return ["unshare", "--mount", "bash", "-c", remount, "bash", *command]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["cpu", "cpu_fsdp"])
def test_a_save_that_fails_midway_stops_the_run_and_loses_nothing(layout, tmp_path):
    world_size = 1 if layout == "cpu" else 2
    train_and_dump(layout, tmp_path, "vae", *RUN, "max_steps=4", world_size=world_size)  # checkpoints 2 and 4

    failed = launch(layout, tmp_path, "max_steps=8", limit_kb=LIMIT_KB)

    errors = [line for line in failed.stderr.splitlines() if line.startswith("accel-trainer: error:")]
    assert failed.returncode != 0 and errors, failed.stderr
    assert all(f"saving the checkpoint of step 6 in {tmp_path / 'checkpoints'} failed" in line for line in errors), (
        errors
    )
    assert all("File too large" in line for line in errors)
    assert any("newest complete checkpoint is step_00000004" in line for line in errors)
    assert len(errors) == (1 if layout == "cpu" else 2)  # one line per process
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    files.verify(tmp_path / "checkpoints" / "step_00000004")

    train_and_dump(layout, tmp_path, "vae", *RUN, "max_steps=8", world_size=world_size)  # with room on the disk

    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == list(range(1, 9))


@pytest.mark.multiprocess
def test_a_checkpoints_folder_that_became_read_only_stops_the_run_in_one_line_and_loses_nothing(tmp_path):
    train_and_dump("cpu", tmp_path, "vae", *RUN, "max_steps=4", world_size=1)  # checkpoints 2 and 4
    checkpoints = tmp_path / "checkpoints"

    failed = launch("cpu", tmp_path, "max_steps=8", read_only=checkpoints)  # a remount, a quota, another user
    checkpoints.chmod(0o755)

    errors = [line for line in failed.stderr.splitlines() if line.startswith("accel-trainer: error:")]
    assert failed.returncode != 0 and len(errors) == 1, failed.stderr
    assert f"saving the checkpoint of step 6 in {checkpoints} failed" in errors[0]
    assert "Read-only file system" in errors[0] or "Permission denied" in errors[0]
    assert "newest complete checkpoint is step_00000004" in errors[0]
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp")]
    files.verify(checkpoints / "step_00000004")

    train_and_dump("cpu", tmp_path, "vae", *RUN, "max_steps=8", world_size=1)  # once the folder is writable again

    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == list(range(1, 9))


def test_a_damaged_metrics_file_or_config_in_a_run_being_resumed_is_a_warning_and_the_run_continues(tmp_path):
    import accel_trainer as at

    settings = dict(output_dir=str(tmp_path), save_every_steps=2, keep_last=0, warmup_steps=0, eval_every_steps=0,
                    log_every_steps=1, show_progress_bar=False, report=False)  # fmt: skip
    at.train("vae", max_steps=4, **settings)
    with open(tmp_path / "metrics.jsonl", "ab") as metrics:
        metrics.write(b'{"step": 5, "lo\xff\xfe\x00 garbage\n{"step": ')  # a crash mid-line, and binary junk
    (tmp_path / "config.yaml").write_bytes(b"\x00\xff: [unclosed")

    with pytest.warns(UserWarning, match=r"metrics.jsonl: dropped 2 unreadable line\(s\)"):
        result = at.train("vae", max_steps=6, **settings)

    assert result.metrics["step"] == 6
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert "max_steps: 6" in (tmp_path / "config.yaml").read_text()


@pytest.mark.multiprocess
@pytest.mark.slow  # waits out the collective timeout and torchrun's 30 s grace
def test_a_hung_peer_ends_every_process_within_the_collective_timeout_with_a_line_each(tmp_path):
    import time

    timeout_s = 10
    command = [*ACCELERATE_LAUNCH, "--config_file", REPO / "accelerate_configs" / "cpu_ddp.yaml",
               "--main_process_port", str(free_port()), WORKERS / "run_recipe.py", "vae_hang",
               f"output_dir={tmp_path}", "max_steps=20", "hang_at_micro_batch=3", *RUN, *TEST_OVERRIDES,
               f"collective_timeout_s={timeout_s}"]  # fmt: skip
    started = time.perf_counter()

    result = run_command(command, env=clean_env(), check=False)

    elapsed = time.perf_counter() - started
    assert result.returncode != 0
    # Setup, the timeout, and the launcher's grace period before SIGKILL: 51 s alone; CI runs it beside `make test`,
    # where a launch's setup alone took up to 40 s. Without the collective timeout it would hang for 30 minutes.
    assert elapsed < timeout_s + 170, elapsed
    lines = [line for line in result.stderr.splitlines() if line.startswith("accel-trainer: rank")]
    # Each says the phase it was in: rank 1 hung in its forward, rank 0 waited in the gradient all-reduce.
    lost = "accel-trainer: rank 0: lost another process during the backward (and gradient reduction) of step 3"
    assert any(line.startswith(lost) and "collective_timeout_s" in line for line in lines), result.stderr
    assert "accel-trainer: rank 1: SIGTERM received during the forward of step 3" in lines, result.stderr
