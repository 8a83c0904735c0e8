"""What `compute_loss` may return, checked once per micro-batch, and the exact token loss in one line.

A recipe's `compute_loss` returns either
    a scalar tensor                          the mean loss over the batch's samples, or
    {"loss": s, "num_items": n, "<name>": t} `s` (and each extra term `t`) summed over `n` items (tokens, say),
                                             which the loop divides by the items of the whole optimizer step
                                             on every process, so the gradient is that of one big batch;
                                             without "num_items", `s` and each `t` are batch means.
Extra terms (reconstruction, KL, task A/B) are logged beside `loss` with the same normalisation and are read
back to the host only on log steps. A term given as a pair `(sum, count)` is a figure with its own count (GRPO's
mean reward over completions, where the loss counts tokens): logged as the log window's sums over its counts, on
every process together, as eval_metrics' pairs are. Anything else (a tuple, a non-scalar loss, a term named like
a logged framework key) is a one-line `RecipeError` naming the fix: a tuple used to be read as `(loss_sum,
num_items)`, so `return loss, recon` silently divided the gradients by the reconstruction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from accel_trainer.errors import RecipeError

# Keys the loop writes into each training record; a recipe's term of the same name would overwrite one.
FRAMEWORK_KEYS = frozenset(
    {
        "step",
        "epoch",
        "loss",
        "num_items",
        "lr",
        "grad_norm",
        "samples_per_s",
        "step_time_s",
        "world_size",
        "skipped_steps",
        "nonfinite_steps",
    }
)
_RESERVED_PREFIXES = ("lr/", "eval/", "eval_ema/")
_FORM = 'return a scalar mean loss, or a mapping {"loss": loss_sum, "num_items": n, "<term>": value}'


@dataclass
class LossOutput:
    """One micro-batch's loss, its item count (None: `loss` is a batch mean), its extra terms (detached), and the
    counts of the terms that came with their own (`(sum, count)`)."""

    loss: torch.Tensor
    num_items: torch.Tensor | None
    terms: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor] = field(default_factory=dict)


def read_loss_output(output: Any) -> LossOutput:
    """Check what `compute_loss` returned and put it in one shape.

    Raises:
        RecipeError: a tuple, a non-scalar loss or term, a mapping without "loss", or a term whose name
            collides with a key the loop logs.
    """
    if isinstance(output, torch.Tensor):
        return LossOutput(_scalar("the loss", output), None, {})
    if isinstance(output, tuple):
        raise RecipeError(f"compute_loss returned a tuple, which is ambiguous; {_FORM}")
    if not isinstance(output, Mapping):
        raise RecipeError(f"compute_loss returned {type(output).__name__}; {_FORM}")
    if "loss" not in output:
        raise RecipeError(f"compute_loss returned a mapping without 'loss' (keys: {', '.join(map(str, output))})")
    num_items = output.get("num_items")
    terms, counts = {}, {}
    for name, value in output.items():
        if name in ("loss", "num_items"):
            continue
        if not isinstance(name, str) or name in FRAMEWORK_KEYS or name.startswith(_RESERVED_PREFIXES):
            raise RecipeError(
                f"compute_loss term {name!r} collides with a key the loop logs ({', '.join(sorted(FRAMEWORK_KEYS))},"
                " lr/*, eval/*): rename it"
            )
        if isinstance(value, tuple) and len(value) == 2:  # (sum, count): a figure with its own count
            value, counts[name] = value[0], _scalar(f"term {name!r}'s count", torch.as_tensor(value[1])).detach()
        terms[name] = _scalar(f"term {name!r}", torch.as_tensor(value)).detach()
    if num_items is not None:
        num_items = _scalar("num_items", torch.as_tensor(num_items))
    return LossOutput(_scalar("the loss", output["loss"]), num_items, terms, counts)


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, *, shift: bool = False
) -> dict[str, torch.Tensor]:
    """Cross-entropy summed over the labelled tokens, with their count: the exact form for `compute_loss`.

        return at.token_cross_entropy(model(batch["input_ids"]), batch["targets"])
        return at.token_cross_entropy(model(**batch).logits, batch["labels"], shift=True)  # transformers

    Args:
        logits: (..., vocabulary) scores, computed in float32 here whatever their precision.
        labels: class indices of the same leading shape; `ignore_index` marks tokens that count for nothing.
        ignore_index: the label of padding and other unscored positions.
        shift: predict labels[..., 1:] from logits[..., :-1, :], as a causal LM whose labels are its inputs
            does (transformers' convention).

    Returns:
        {"loss": summed loss, "num_items": number of labelled tokens}, which the loop normalises by the
        token count of the whole optimizer step (transformers' own `out.loss` is a per-micro-batch mean,
        inexact under accumulation).
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    losses = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index, reduction="none"
    )
    return {"loss": losses.sum(), "num_items": (labels != ignore_index).sum()}


def _scalar(what: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise RecipeError(f"compute_loss: {what} is a {type(value).__name__}, not a tensor; {_FORM}")
    if value.dim() != 0:
        raise RecipeError(
            f"compute_loss: {what} has shape {list(value.shape)}, not a scalar; reduce it (mean over the batch,"
            " or a sum with num_items)"
        )
    return value
