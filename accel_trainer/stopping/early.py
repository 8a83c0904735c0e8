"""Early stopping on an eval metric: stop when `early_stop_metric` has not improved for `early_stop_patience`
evaluations.

The decision needs no collective: every process holds the same evaluation scores (gathered over all of them),
so all stop at the same step. The count survives a resume (TrainState), the stop saves a checkpoint at its step
and ends the run normally (final weights, report, exit 0) with one line saying why, and `resume=auto` on a run
that stopped early says so and trains nothing. The best checkpoint is kept with `keep_best_metric` (the same
metric, typically). A NaN or infinite evaluation never counts as an improvement, and the stop says so.
"""

from __future__ import annotations

import math
from typing import Any

from accel_trainer.checkpoint.train_state import TrainState
from accel_trainer.config.train_config import TrainConfig, check_measurable, metric_of


def check_early_stop(cfg: TrainConfig, has_eval: bool) -> None:
    """Refuse an early_stop_metric that could never be measured, before any training.

    Raises:
        ConfigError: not an eval metric, no eval set, or no evaluation before the end (engine/evaluator.py).
    """
    if cfg.early_stop_metric:
        check_measurable("early_stop_metric", cfg.early_stop_metric, cfg, has_eval)


def should_stop_early(cfg: TrainConfig, state: TrainState, scores: dict[str, Any] | None) -> str:
    """Note this evaluation; the line to stop with, or "" to go on (updates `state`)."""
    name = cfg.early_stop_metric
    if not name or scores is None:
        return ""
    value, best = metric_of("early_stop_metric", name, scores), state.early_stop_best
    gain = (best - value if cfg.early_stop_mode == "min" else value - best) if best is not None else float("inf")
    if math.isfinite(value) and gain > cfg.early_stop_min_delta:  # NaN or inf is never an improvement
        state.early_stop_best, state.early_stop_best_step, state.early_stop_waited = value, state.step, 0
        return ""
    state.early_stop_waited += 1
    if state.early_stop_waited < cfg.early_stop_patience:
        return ""
    state.stopped_early = True
    waited = f"for {state.early_stop_waited} evaluation(s)" + ("" if math.isfinite(value) else f", the last {value}")
    if best is None:
        return f"early stop after step {state.step}: {name} has not been finite {waited}"
    since = f"{best:.6g} (step {state.early_stop_best_step})"
    return f"early stop after step {state.step}: {name} has not improved on {since} {waited}"
