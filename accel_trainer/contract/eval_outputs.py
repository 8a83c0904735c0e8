"""What `eval_metrics` may return, checked on every eval batch and read into sums.

A recipe's `eval_metrics(model, batch)` returns a flat mapping of metric names to one of
    a tensor of shape [rows]           one value per sample: reported as its mean over the eval set;
    a 0-dim tensor or a Python number  the batch's mean: weighted by the batch's rows, so it is exact too;
    a pair (sums, num_items)           per-sample (or per-batch) sums and the items they are over (tokens,
                                       say): reported as sum of sums / sum of num_items, for this metric only.
A top-level "num_items" entry weights the one metric beside it (the short form of the pair); beside two or
more it is refused, since it used to weight all of them: a token count turned a 0.94 accuracy into 0.03.

Evaluation only ever passes the real rows of a batch (engine/evaluator.py drops the duplicates that even out the
last batch before calling the recipe), so a batch mean is the mean of real samples. Anything else (a nested
mapping, a list, a tensor of another shape) is a one-line `RecipeError` naming the form.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Real
from typing import Any

import torch

from accel_trainer.errors import RecipeError

_PAIR = ("sums", "num_items")
Sums = dict[str, tuple[torch.Tensor, torch.Tensor]]  # metric -> (sum of values, sum of weights), 0-dim
_FORM = (
    "return {name: per-sample tensor of shape [rows], a batch mean, or a pair (per-sample sums, num_items)},"
    " e.g. {'loss': (token_loss_sums, token_counts), 'accuracy': correct.float()}"
)


def metric_sums(output: Any, rows: int, device: torch.device) -> Sums:
    """The sums of one batch's eval metrics and of their weights, as float32 0-dim tensors on `device`.

    Args:
        output: what `eval_metrics` returned for a batch of `rows` samples.
        rows: the number of real samples the batch holds.
        device: where the sums are kept (the loop's device, so that adding them up needs no synchronisation).

    Raises:
        RecipeError: not a flat mapping of the forms above, a shape that is not one value per sample, or a
            top-level num_items beside several metrics.
    """
    if not isinstance(output, Mapping):
        raise RecipeError(f"eval_metrics returned {type(output).__name__}; {_FORM}")
    metrics = dict(output)
    num_items = metrics.pop("num_items", None)
    if num_items is not None:
        if len(metrics) != 1:
            raise RecipeError(
                f"eval_metrics returned 'num_items' beside {len(metrics)} metrics ({', '.join(map(str, metrics))}):"
                " say which it weights, as a pair {'loss': (loss_sums, num_items)}; the others stay per-sample means"
            )
        ((name, value),) = metrics.items()
        metrics = {name: (value, num_items)}
    return {_name(name): _sum_and_weight(name, value, rows, device) for name, value in metrics.items()}


def _name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise RecipeError(f"eval_metrics returned the metric name {name!r}: name each metric with a string")
    return name


def _sum_and_weight(name: str, value: Any, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, weight) of one metric: its per-sample values and `rows`, or the pair's sums and items."""
    if isinstance(value, tuple) and len(value) == 2:
        sums, items = (_values(f"{name!r} ({part})", value[i], rows, device) for i, part in enumerate(_PAIR))
        return sums.sum(), items.sum()
    values = _values(repr(name), value, rows, device)
    if values.ndim == 0:  # a batch mean
        return values * rows, torch.tensor(float(rows), device=device)
    return values.sum(), torch.tensor(float(rows), device=device)


def _values(what: str, value: Any, rows: int, device: torch.device) -> torch.Tensor:
    """A metric's values as float32 on `device`: a 0-dim tensor (or number), or one value per sample."""
    if isinstance(value, Real):
        return torch.tensor(float(value), device=device)
    if not isinstance(value, torch.Tensor):
        raise RecipeError(f"eval metric {what} is a {type(value).__name__}; {_FORM}")
    if value.ndim > 1 or (value.ndim == 1 and len(value) != rows):
        raise RecipeError(
            f"eval metric {what} has shape {tuple(value.shape)} for a batch of {rows} samples: return one value"
            f" per sample (shape [{rows}]), e.g. reduce the other dimensions with .sum(dim=1), or a batch mean"
        )
    return value.detach().to(device, torch.float32)
