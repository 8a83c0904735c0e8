"""Early stopping on an eval metric: stop when `early_stop_metric` has not improved for `early_stop_patience`
evaluations.

The decision needs no collective: every process holds the same evaluation scores (gathered over all of them),
so all stop at the same step. The count survives a resume (`EarlyStopping` is saved in each checkpoint), the
stop saves a checkpoint at its step and ends the run normally (final weights, report, exit 0) with one line
saying why, and `resume=auto` on a run that stopped early says so and trains nothing. The best checkpoint is
kept with `keep_best_metric` (the same metric, typically). A NaN or infinite evaluation never counts as an
improvement, and the stop says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from accel_trainer.checkpoint.train_state import SavedFields
from accel_trainer.config.eval_settings import check_measurable, metric_of
from accel_trainer.config.train_config import TrainConfig


def check_early_stop(cfg: TrainConfig, has_eval: bool) -> None:
    """Refuse an early_stop_metric that could never be measured, before any training.

    Raises:
        ConfigError: not an eval metric, no eval set, or no evaluation before the end (engine/evaluator.py).
    """
    if cfg.early_stop_metric:
        check_measurable("early_stop_metric", cfg.early_stop_metric, cfg, has_eval)


@dataclass
class EarlyStopping(SavedFields):
    """Early stopping's state, saved in each checkpoint: the best `early_stop_metric` so far, the step of that
    evaluation, the evaluations since without an improvement, and whether the run stopped on it."""

    early_stop_best: float | None = None
    early_stop_best_step: int = 0
    early_stop_waited: int = 0
    """Evaluations since the best without an improvement of more than early_stop_min_delta."""
    stopped_early: bool = False
    """The run ended on early stopping: resume=auto has nothing left to train."""

    def after_evaluation(self, cfg: TrainConfig, step: int, scores: dict[str, Any] | None) -> str:
        """Note the evaluation of `step`; the line to stop with, or "" to go on."""
        name = cfg.early_stop_metric
        if not name or scores is None:
            return ""
        value, best = metric_of("early_stop_metric", name, scores), self.early_stop_best
        gain = (best - value if cfg.early_stop_mode == "min" else value - best) if best is not None else float("inf")
        if math.isfinite(value) and gain > cfg.early_stop_min_delta:  # NaN or inf is never an improvement
            self.early_stop_best, self.early_stop_best_step, self.early_stop_waited = value, step, 0
            return ""
        self.early_stop_waited += 1
        if self.early_stop_waited < cfg.early_stop_patience:
            return ""
        self.stopped_early = True
        last = "" if math.isfinite(value) else f", the last {value}"
        waited = f"for {self.early_stop_waited} evaluation(s){last}"
        if best is None:
            return f"early stop after step {step}: {name} has not been finite {waited}"
        since = f"{best:.6g} (step {self.early_stop_best_step})"
        return f"early stop after step {step}: {name} has not improved on {since} {waited}"
