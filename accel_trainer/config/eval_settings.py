"""The settings that name an eval metric (keep-best, early stopping), checked before any training, and when a run
evaluates."""

from __future__ import annotations

from typing import Any

from accel_trainer.config.train_config import TrainConfig
from accel_trainer.errors import ConfigError


def check_measurable(setting: str, name: str, cfg: TrainConfig, has_eval: bool) -> None:
    """Refuse a setting naming an eval metric that could never be measured during the run (keep-best, early
    stopping), before any training.

    Raises:
        ConfigError: not an eval metric (eval/<name>, or eval_ema/<name> with evaluate_ema), no eval set, or no
            evaluation before the end.
    """
    if name.startswith("eval_ema/") and not cfg.evaluate_ema:
        raise ConfigError(f"{setting}={name!r} is a metric of the EMA weights: set evaluate_ema=true and ema_decay")
    if not name.startswith(("eval/", "eval_ema/")):
        raise ConfigError(f"{setting}={name!r}: name an eval metric, such as eval/loss")
    if not has_eval:
        raise ConfigError(f"{setting}={name!r}: this recipe has no eval set to measure it on")
    if cfg.eval_every_steps <= 0:
        raise ConfigError(
            f"{setting}={name!r} needs evaluations during the run: set eval_every_steps (it is 0, which"
            " evaluates only at the end)"
        )


def metric_of(setting: str, name: str, scores: dict[str, Any]) -> float:
    """The value of the eval metric a setting names, or a one-line error listing the recipe's metrics (raised at
    the step-0 evaluation, before any training)."""
    if name not in scores:
        raise ConfigError(
            f"{setting}={name!r} is not among the eval metrics this recipe returns ({', '.join(sorted(scores))}):"
            " use one of those"
        )
    return float(scores[name])


def evaluates_after(cfg: TrainConfig, step: int) -> bool:
    """Whether an evaluation follows `step`: every eval_every_steps, and at the end."""
    return step == cfg.max_steps or (cfg.eval_every_steps > 0 and step % cfg.eval_every_steps == 0)
