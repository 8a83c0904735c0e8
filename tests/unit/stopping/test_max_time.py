"""max_time: a wall-clock budget that ends a run like a preemption (checkpoint, exit 75), for chained jobs.

A bad duration is a one-line error before any work. A run whose budget is spent saves at the step it reached and
exits 75 with one line saying so; the same command continues from there. On two processes both stop at one
agreed step (the budget is checked in the same collective as the preemption signals).
"""

from __future__ import annotations

import pytest

from accel_trainer import ConfigError, training
from accel_trainer.config.fields import parse_duration
from accel_trainer.stopping.signals import EXIT_PREEMPTED
from conftest import REPO, accelerate_launch, exit_status


@pytest.mark.parametrize(
    ("text", "seconds"), [("2h30m", 9000), ("90m", 5400), ("45s", 45), ("1d", 86400), ("1.5h", 5400)]
)
def test_a_duration_is_days_hours_minutes_and_seconds(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["10", "2x", "h", "5m3"])
def test_anything_else_is_a_one_line_error(text):
    with pytest.raises(ConfigError, match="write a duration such as 2h30m"):
        parse_duration(text)


MLP = [REPO / "recipes" / "mlp.py", "max_steps=1000000", "log_every_steps=100000", "eval_every_steps=0",
       "show_progress_bar=false"]  # fmt: skip


def stopped_at(output: str, budget: str) -> int:
    (line,) = [line for line in output.splitlines() if "stopped by" in line]
    assert line.startswith(f"accel-trainer: stopped by max_time={budget} after step ") and "rerun the same" in line
    return int(line.split("after step ")[1].split(";")[0])


def test_a_spent_budget_saves_exits_75_and_the_same_command_continues(tmp_path, capsys):
    """`python recipes/mlp.py ... max_time=2s` twice, through the script's entry point in this process (the budget
    counts from the run's start, not the process's)."""
    overrides = [*(str(word) for word in MLP[1:]), "max_time=2s", f"output_dir={tmp_path}", "report=false"]
    first = exit_status(training.main, "mlp", overrides)
    first_output = capsys.readouterr()
    assert first == EXIT_PREEMPTED
    stopped = stopped_at(first_output.out + first_output.err, "2s")
    assert (tmp_path / "checkpoints" / f"step_{stopped:08d}").is_dir()
    second = exit_status(training.main, "mlp", overrides)  # the next job of a chain
    second_output = capsys.readouterr()
    assert second == EXIT_PREEMPTED and stopped_at(second_output.out + second_output.err, "2s") > stopped
    assert f"resuming from {tmp_path / 'checkpoints' / f'step_{stopped:08d}'} at step {stopped}" in second_output.out


def test_a_budget_is_bookkeeping_so_the_next_job_may_have_another():
    from accel_trainer.checkpoint.checks import _BOOKKEEPING_KEYS

    assert "max_time" in _BOOKKEEPING_KEYS


@pytest.mark.multiprocess
def test_two_processes_spend_their_budget_together(tmp_path):
    """Each process says the budget stopped it, also the one whose own clock had not yet passed it when the other's
    had (it said "stopped by a signal to another process", seen in a fresh-clone CI run)."""
    result = accelerate_launch("cpu_ddp", *MLP, "max_time=4s", f"output_dir={tmp_path}", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output  # the launcher reports its workers' 75 as a failure
    steps = {int(line.split("after step ")[1].split(";")[0])
             for line in output.splitlines() if "stopped by max_time=4s" in line}  # fmt: skip
    assert len(steps) == 1, output
    assert (tmp_path / "checkpoints" / f"step_{steps.pop():08d}").is_dir()
