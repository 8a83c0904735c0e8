"""The checkpointer owns the run's progress, the save cadence, keep-best and retention.

keep-best sees every evaluation: a new best off the save cadence is saved at its step. A metric name that
cannot be measured is a one-line error before any training.
"""

from __future__ import annotations

import json

import pytest

import accel_trainer as at
from accel_trainer.checkpoint.checkpointer import KeepBest
from accel_trainer.checkpoint.train_state import TrainState
from conftest import read_metrics

QUIET = {"show_progress_bar": False, "report": False, "log_every_steps": 0}


def kept_steps(run_dir) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def train_state(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "train_state.json").read_text())


def test_a_new_best_evaluation_off_the_save_cadence_is_saved_and_kept(tmp_path):
    # keep_best_mode=max keeps the highest eval loss: an early evaluation, long before the only cadence save.
    at.train("vae", max_steps=12, save_every_steps=0, eval_every_steps=3, keep_last=1, keep_best_metric="eval/loss",
             keep_best_mode="max", output_dir=str(tmp_path), **QUIET)  # fmt: skip

    evals = {r["step"]: r["eval/loss"] for r in read_metrics(tmp_path) if "eval/loss" in r and r["step"] > 0}
    best_step = max(evals, key=evals.get)
    assert best_step < 12
    assert kept_steps(tmp_path) == [best_step, 12]
    state = train_state(tmp_path, 12)
    assert (state["best_metric"], state["best_checkpoint"]) == (evals[best_step], f"step_{best_step:08d}")


def test_an_unknown_keep_best_metric_stops_at_the_baseline_evaluation_naming_the_known_ones(tmp_path):
    with pytest.raises(at.ConfigError, match=r"keep_best_metric='eval/accuracy' is not among .*eval/loss"):
        at.train("vae", max_steps=5, eval_every_steps=5, keep_best_metric="eval/accuracy", output_dir=str(tmp_path),
                 **QUIET)  # fmt: skip
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]  # no step was trained
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"keep_best_metric": "loss", "eval_every_steps": 5}, "name an eval metric"),
     ({"keep_best_metric": "eval/loss", "eval_every_steps": 0}, "set eval_every_steps")],
)  # fmt: skip
def test_a_keep_best_metric_that_could_never_be_measured_is_refused_before_training(overrides, message, tmp_path):
    with pytest.raises(at.ConfigError, match=message):
        at.train("vae", max_steps=5, output_dir=str(tmp_path), **overrides, **QUIET)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_saved_progress_counts_samples_and_items_at_a_save_between_log_steps(tmp_path):
    at.train("vae", max_steps=4, save_every_steps=3, keep_last=0, output_dir=str(tmp_path),
             **{**QUIET, "log_every_steps": 2})  # fmt: skip

    at_3, at_4 = train_state(tmp_path, 3), train_state(tmp_path, 4)
    assert (at_3["step"], at_3["samples_seen"], at_3["items_seen"], at_3["epoch"]) == (3, 192, 192.0, 1)
    assert (at_4["samples_seen"], at_4["items_seen"]) == (256, 256.0)  # the step-3 items are not counted twice


def test_an_older_train_state_without_the_newer_keys_loads_with_their_defaults():
    progress, best = TrainState(), KeepBest()
    for state in (progress, best):
        state.load_state_dict({"step": 7, "skipped_steps": 1, "format": 2, "recipe": "vae"})
    assert (progress.step, progress.skipped_steps, progress.metrics, best.best_metric) == (7, 1, {}, None)
