"""Evaluation: the means of a recipe's per-sample eval metrics over the whole eval set, on any layout."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from .batchnorm import average_running_stats
from .pipeline import Pipeline
from .recipe import Recipe


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
