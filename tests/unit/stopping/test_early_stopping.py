"""Early stopping on an eval metric: every process stops at the same evaluation, with a checkpoint and one line.

The rule (patience counted in evaluations, min or max, a minimum improvement) on its own; a run that stops early
saves at that step, logs a training record there, ends normally with its final weights, and `resume=auto`
trains nothing more; an unmeasurable metric is a one-line error; on two processes both stop at one step.
"""

from __future__ import annotations

import pytest

import accel_trainer as at
from accel_trainer import ConfigError
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.stopping.early import EarlyStopping, check_early_stop
from conftest import read_metrics, train_and_dump


def run_rule(values, **settings) -> list[str]:
    cfg, early = TrainConfig(early_stop_metric="eval/loss", **settings), EarlyStopping()
    return [early.after_evaluation(cfg, step, {"eval/loss": value}) for step, value in enumerate(values, start=1)]


def test_it_stops_after_patience_evaluations_without_improvement():
    lines = run_rule([3.0, 2.0, 2.5, 2.1, 2.2], early_stop_patience=3)
    assert lines[:4] == ["", "", "", ""]
    assert lines[4] == "early stop after step 5: eval/loss has not improved on 2 (step 2) for 3 evaluation(s)"


def test_an_improvement_resets_the_count_and_min_delta_decides_what_counts():
    assert not any(run_rule([3.0, 3.1, 2.9, 3.0, 2.8], early_stop_patience=2))
    assert run_rule([3.0, 2.99, 2.98], early_stop_patience=2, early_stop_min_delta=0.05)[-1].startswith("early stop")


def test_a_nan_evaluation_is_never_an_improvement_and_the_stop_line_says_it_was_nan():
    nan = float("nan")
    lines = run_rule([2.0, nan, nan], early_stop_patience=2)
    stop = "early stop after step 3: eval/loss has not improved on 2 (step 1) for 2 evaluation(s), the last nan"
    assert lines[2] == stop
    assert not any(run_rule([nan, 2.0, 1.0], early_stop_patience=2))  # a NaN first evaluation is no best to beat


def test_a_metric_that_was_never_finite_stops_with_that_reason_not_on_nan():
    lines = run_rule([float("nan"), float("inf")], early_stop_patience=2)
    assert lines[1] == "early stop after step 2: eval/loss has not been finite for 2 evaluation(s), the last inf"


def test_max_mode_for_accuracies():
    assert run_rule([0.5, 0.7, 0.6], early_stop_patience=1, early_stop_mode="max")[-1].startswith("early stop")
    assert not any(run_rule([0.5, 0.7, 0.8], early_stop_patience=1, early_stop_mode="max"))


@pytest.mark.parametrize(
    ("settings", "has_eval", "message"),
    [({"early_stop_metric": "loss", "eval_every_steps": 10}, True, "name an eval metric"),
     ({"early_stop_metric": "eval/loss", "eval_every_steps": 10}, False, "has no eval set"),
     ({"early_stop_metric": "eval/loss", "eval_every_steps": 0}, True, "set eval_every_steps")],
)  # fmt: skip
def test_a_metric_that_cannot_be_measured_is_a_one_line_error(settings, has_eval, message):
    with pytest.raises(ConfigError, match=message):
        check_early_stop(TrainConfig(**settings), has_eval)


EARLY = dict(max_steps=5000, eval_every_steps=100, log_every_steps=1000, early_stop_metric="eval/loss",
             early_stop_patience=2, show_progress_bar=False, report=False)  # fmt: skip


def test_a_run_that_stops_early_saves_there_and_a_resume_trains_nothing_more(tmp_path, capsys):
    at.train("mlp", **EARLY, output_dir=str(tmp_path))
    out = capsys.readouterr()
    (line,) = [line for line in (out.out + out.err).splitlines() if "early stop after step" in line]
    stopped = int(line.split("after step ")[1].split(":")[0])
    assert stopped < 5000 and stopped % 100 == 0
    assert (tmp_path / "checkpoints" / f"step_{stopped:08d}").is_dir() and (tmp_path / "final").is_dir()
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r][-1] == stopped  # a training record there
    at.train("mlp", **EARLY, output_dir=str(tmp_path))
    assert f"stopped early at step {stopped} of max_steps=5000: nothing to train" in capsys.readouterr().out


def test_an_unknown_metric_name_is_a_one_line_error_at_the_first_evaluation(tmp_path):
    with pytest.raises(ConfigError, match="early_stop_metric='eval/acc' is not among the eval metrics"):
        at.train("mlp", **{**EARLY, "early_stop_metric": "eval/acc"}, output_dir=str(tmp_path))


@pytest.mark.multiprocess
def test_two_processes_stop_at_the_same_evaluation(tmp_path):
    overrides = [f"{key}={value}" for key, value in EARLY.items()]
    records = train_and_dump("cpu_ddp", tmp_path, "mlp", *overrides, world_size=2)
    evaluations = [r["step"] for r in records if "eval/loss" in r]
    assert evaluations[-1] < 5000 and (tmp_path / "checkpoints" / f"step_{evaluations[-1]:08d}").is_dir()
