"""Runs stopped by a signal lose nothing (processes killed outright: test_killed_workers.py).

- A stop signal (SIGTERM, SIGINT) to every process at once, as a scheduler or a terminal's Ctrl-C sends it,
  with the launcher forwarding its own copy a moment later: at set-up, mid-step, during an evaluation or a
  save, every rank stops at one agreed step, saves once, exits 75, and `resume=auto` ends with the parameters
  of the uninterrupted run. A copy that arrives within preemption.REPEAT_WINDOW_S of the first is not a
  second press; a second signal after it quits at once, leaving the last checkpoint intact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from accel_trainer.checkpoint import files
from accel_trainer.stopping.signals import EXIT_PREEMPTED
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    LAUNCH_TIMEOUT_S,
    REPO,
    SIGNALLED,
    SLOW_STEP,
    TEST_OVERRIDES,
    WORKERS,
    assert_bitwise,
    clean_env,
    final_parameters,
    free_port,
    logged_steps,
    train_and_dump,
    wait_for,
)

pytestmark = pytest.mark.multiprocess


def start_signalled_run(run_dir: Path, markers: Path, world_size: int, **slow: str) -> subprocess.Popen:
    """mlp_slow through `at.main` (tests/workers/signalled_run.py) on 1 process, or on 2 under accelerate launch."""
    markers.mkdir(exist_ok=True)
    worker = [str(WORKERS / "signalled_run.py"), "mlp_slow", *SIGNALLED, f"output_dir={run_dir}", *TEST_OVERRIDES]
    launcher = [str(BIN / "python")]
    if world_size > 1:
        launcher = [*ACCELERATE_LAUNCH, "--quiet", "--config_file",
                    str(REPO / "accelerate_configs/cpu_ddp.yaml"), "--main_process_port", str(free_port())]  # fmt: skip
    env = clean_env(ACCEL_TEST_MARKERS=str(markers), **slow)
    return subprocess.Popen([*launcher, *worker], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def worker_pids(markers: Path, world_size: int) -> list[int]:
    wait_for(lambda: all((markers / f"pid.rank{rank}").exists() for rank in range(world_size)))
    return [int((markers / f"pid.rank{rank}").read_text()) for rank in range(world_size)]


def stopped_step(output: str, signal_name: str) -> int:
    """The step of the one "stopped by" line the main process prints."""
    stops = [line for line in output.splitlines() if f"stopped by {signal_name} after step" in line]
    assert len(stops) == 1, output
    return int(stops[0].split("after step ")[1].split(";")[0])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference: mlp_slow's config on 2 processes, never signalled (and not slowed)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train_and_dump("cpu_ddp", run_dir, "mlp_slow", *SIGNALLED, world_size=2)
    return run_dir


WAIT_FOR = {  # each phase: how the run is slowed, and the moment the signal is sent
    "mid-step": (SLOW_STEP, lambda run_dir, markers: logged_steps(run_dir) >= 3),
    "evaluation": ({**SLOW_STEP, "ACCEL_TEST_SLOW_EVAL_S": "0.3"},
                   lambda _, markers: (markers / "eval.rank0").exists()),
    "setup": ({**SLOW_STEP, "ACCEL_TEST_SLOW_SETUP_S": "2"},
              lambda _, markers: all((markers / f"setup.rank{r}").exists() for r in (0, 1))),
    "save": ({**SLOW_STEP, "ACCEL_TEST_SLOW_SAVE_S": "2"}, lambda _, markers: (markers / "save.rank0").exists()),
}  # fmt: skip


@pytest.mark.parametrize(
    ("signal_name", "targets", "phase"),
    [
        # every phase, both signals and each order at least once (CI time: each case is a 40 s launch); a signal
        # to the launcher alone, which forwards it, is test_slurm.py's (srun's SIGUSR1 to accel-trainer's launcher)
        ("SIGTERM", "workers, then the launcher", "mid-step"),
        ("SIGTERM", "the launcher, then the workers", "evaluation"),
        ("SIGINT", "workers, then the launcher", "setup"),
        ("SIGTERM", "workers, then the launcher", "save"),
    ],
)
def test_a_signal_to_every_process_of_a_two_process_launch_saves_once_at_one_agreed_step_and_resumes_exactly(
    signal_name, targets, phase, uninterrupted, tmp_path
):
    run_dir, markers = tmp_path / "run", tmp_path / "markers"
    slowed, moment = WAIT_FOR[phase]
    launcher = start_signalled_run(run_dir, markers, 2, **slowed)
    try:
        workers = worker_pids(markers, 2)
        wait_for(lambda: moment(run_dir, markers) or launcher.poll() is not None)
        order = [launcher.pid, *workers]
        for pid in order if targets.startswith("the launcher") else order[::-1]:  # a scheduler's, then the copy
            os.kill(pid, getattr(signal, signal_name))
        output = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    finally:
        launcher.kill()

    stopped_at = stopped_step(output, signal_name)
    assert "lost another process" not in output and "KeyboardInterrupt" not in output, output
    saved = files.complete_checkpoints(run_dir)
    assert files.recorded_step(saved[-1]) == stopped_at
    files.verify(saved[-1])
    if phase == "save":  # the step-10 save was under way; the loop stops after it or after one more step
        assert [files.recorded_step(folder) for folder in saved] in ([10], [10, 11]), output
    else:
        assert len(saved) == 1, output
        assert stopped_at == {"setup": 1, "evaluation": 10}.get(phase, stopped_at), output
    train_and_dump("cpu_ddp", run_dir, "mlp_slow", *SIGNALLED, world_size=2)  # resume=auto: the rest of the run
    assert_bitwise(final_parameters(uninterrupted), final_parameters(run_dir))


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_the_second_copy_of_a_signal_within_a_moment_is_not_a_second_press_the_run_saves_and_exits_75(
    signal_name, tmp_path
):
    run_dir = tmp_path / "run"
    run = start_signalled_run(run_dir, tmp_path / "markers", 1, **SLOW_STEP)
    try:
        wait_for(lambda: logged_steps(run_dir) >= 3 or run.poll() is not None)
        run.send_signal(getattr(signal, signal_name))
        time.sleep(0.03)  # a launcher forwards its copy within a few milliseconds
        run.send_signal(getattr(signal, signal_name))
        output = run.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    finally:
        run.kill()

    assert run.returncode == EXIT_PREEMPTED, output
    [saved] = files.complete_checkpoints(run_dir)
    assert files.recorded_step(saved) == stopped_step(output, signal_name)
    files.verify(saved)


def test_a_second_ctrl_c_after_the_window_quits_at_once_and_leaves_the_last_checkpoint_intact(tmp_path):
    run_dir = tmp_path / "run"
    run = start_signalled_run(run_dir, tmp_path / "markers", 1, **SLOW_STEP, ACCEL_TEST_SLOW_SAVE_S="20")
    try:  # the stop's save takes 20 s: the second press comes 1.5 s into it
        wait_for(lambda: logged_steps(run_dir) >= 12 or run.poll() is not None)
        run.send_signal(signal.SIGINT)
        time.sleep(1.5)
        run.send_signal(signal.SIGINT)
        second = time.monotonic()
        output = run.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    finally:
        run.kill()

    # at once: not after the 18.5 s left of the save (exiting alone took 12 s once, at a load of 8)
    assert time.monotonic() - second < 15, output
    assert run.returncode not in (0, EXIT_PREEMPTED), output
    [saved] = files.complete_checkpoints(run_dir)  # the step-10 checkpoint, and no other
    assert files.recorded_step(saved) == 10
    files.verify(saved)


@pytest.mark.parametrize("signal_name", ["SIGINT", None], ids=["ctrl-c-killing-tee", "reader-gone"])
def test_a_run_whose_output_pipe_loses_its_reader_still_saves_and_exits_75(signal_name, tmp_path):
    # `accel-trainer train ... | tee log` and a Ctrl-C: tee dies of it too, and the next step line once raised
    # BrokenPipeError mid-step: the run ended with status 1 and no checkpoint. A reader gone alone (`| head`) stops
    # the run the same way, with its checkpoint.
    run_dir = tmp_path / "run"
    worker = [str(BIN / "python"), str(WORKERS / "signalled_run.py"), "mlp_slow", *SIGNALLED, f"output_dir={run_dir}",
              *TEST_OVERRIDES]  # fmt: skip
    run = subprocess.Popen(worker, cwd=REPO, env=clean_env(**SLOW_STEP), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(lambda: logged_steps(run_dir) >= 2)
    run.stdout.close()  # what tee's death leaves: a pipe without a reader
    if signal_name:
        run.send_signal(signal.SIGINT)
    _, errors = run.communicate(timeout=LAUNCH_TIMEOUT_S)

    assert run.returncode == EXIT_PREEMPTED, errors
    stopped_at = stopped_step(errors, signal_name or "a closed stdout")
    [saved] = files.complete_checkpoints(run_dir)
    assert files.recorded_step(saved) == stopped_at
