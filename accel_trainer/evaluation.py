"""Evaluation: the means of a recipe's per-sample eval metrics over the whole eval set, on any layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from .batchnorm import average_running_stats
from .config import TrainConfig
from .errors import ConfigError
from .pipeline import Pipeline
from .recipe import Recipe
from .rng_states import rng_untouched

if TYPE_CHECKING:
    from .prepared_run import Run


def evaluates_after(cfg: TrainConfig, step: int) -> bool:
    """Whether an evaluation follows `step`: every eval_every_steps, and at the end."""
    return step == cfg.max_steps or (cfg.eval_every_steps > 0 and step % cfg.eval_every_steps == 0)


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


def evaluate(
    accelerator: Accelerator, recipe: Recipe | Pipeline, model: torch.nn.Module, batches: Any, padded: bool
) -> dict[str, float]:
    """Means of the recipe's per-sample eval metrics over the whole eval set, each sample counted once (on a
    pipeline layout, `recipe` is the pipeline, which runs the recipe's eval_metrics on its last stage).

    Metrics are divided by the number of samples, or by the total of a `num_items` entry when the recipe
    returns one (per-sample sums over tokens, giving a token-weighted mean). A `padded` loader's batches are
    gathered with `gather_for_metrics`, which drops the duplicates that even out its last batch; a stream's
    (streams.eval_batches: disjoint, unequal per process) are summed here and the sums combined.
    """
    average_running_stats(accelerator, model)
    model.eval()
    sums: dict[str, Any] = {}
    with torch.no_grad():
        for batch in batches:
            metrics = recipe.eval_metrics(model, batch)
            if "num_items" not in metrics:
                metrics = {**metrics, "num_items": torch.ones(len(next(iter(metrics.values()))))}
            values = {k: v.float().to(accelerator.device) for k, v in metrics.items()}
            for name, value in (accelerator.gather_for_metrics(values) if padded else values).items():
                sums[name] = sums.get(name, 0) + value.sum()
    model.train()
    if not padded:  # a process may have had no eval batch at all: combine on the host, eval is rare
        totals: dict[str, float] = {}
        for part in gather_object([{name: float(total) for name, total in sums.items()}]):
            for name, total in part.items():
                totals[name] = totals.get(name, 0.0) + total
        sums = totals
    num_items = sums.pop("num_items")
    return {f"eval/{name}": float(total / num_items) for name, total in sums.items()}


def evaluate_run(run: Run) -> dict[str, float]:
    """The run's eval metrics (`eval/<name>`) and, with evaluate_ema, its EMA weights' (`eval_ema/<name>`); the
    random streams are left as they were, so training does not depend on when it evaluates."""
    with rng_untouched():
        scores = evaluate(run.accelerator, run.evaluator, run.model, *run.eval_batches())
        if run.cfg.evaluate_ema and run.ema is not None:
            with run.ema.swapped_in():
                averaged = evaluate(run.accelerator, run.evaluator, run.model, *run.eval_batches())
            scores.update({"eval_ema/" + name.removeprefix("eval/"): value for name, value in averaged.items()})
    return scores
