"""A transformers model's own loss (`return model(**batch).loss`), made exact under accumulation and data
parallelism, as the HF Trainer makes it.

transformers' losses are a mean over the micro-batch's items (tokens) unless the forward is given
`num_items_in_batch`, in which case they sum and divide by that. So, like the Trainer (`get_batch_samples`),
the loop fetches the step's micro-batches first, counts the items of their `labels` (`labels[..., 1:]` where the
model's loss shifts them, as a causal LM's does; `shift_labels` as they are) on every process, adds the counts
up over the processes, and a forward pre-hook passes that total to every training forward that is given
labels. The recipe's loss is then read as this micro-batch's items' sum (loss x total) with its item count:
the `num_items` path of losses.py, which normalises gradients and the logged loss by the items of the whole
step, the same as `at.token_cross_entropy`.

The model must accept the argument (transformers' own test: `accepts_loss_kwargs`, else `**kwargs` in its
forward). The first forward checks that the labels the recipe passed count as many items as the batch's did.
Where the count cannot be made before the forward (no `labels` in the batch, a pipeline or context-parallel
layout) and the step has several micro-batches or processes, one warning names `at.token_cross_entropy`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from accelerate import Accelerator

from accel_trainer.contract.losses import LossOutput
from accel_trainer.errors import RecipeError

IGNORE_INDEX = -100  # transformers' label for "no loss here"
_FIX = "return at.token_cross_entropy(out.logits, labels, shift=True) from compute_loss instead"


class ModelItems:
    """Counts a step's label items before its forwards and passes the total to the model (see the module doc)."""

    def __init__(self, model: torch.nn.Module, shifts: bool, countable: bool, warn: bool) -> None:
        self.shifts, self.countable, self.warn = shifts, countable, warn
        self.total: torch.Tensor | None = None  # the step's items over all processes
        self.counts: list[torch.Tensor | None] = []  # this process's items per micro-batch
        self.current: int | None = None  # the micro-batch whose forward is running (None: not training)
        self.passed = False  # whether the current forward was given num_items_in_batch
        self.checked = False
        model.register_forward_pre_hook(self._pass_total, with_kwargs=True)

    def fetch_step(
        self, batches: Iterator[tuple[int, Any]], count: int, accelerator: Accelerator, copies: int
    ) -> Iterator[tuple[int, Any]]:
        """Fetch the step's `count` micro-batches, count their items on this process and their total over the
        processes (`copies` processes hold each data-parallel rank's batches: tensor or pipeline ranks); the
        micro-batches, to iterate as `batches` would have given them."""
        fetched = [next(batches) for _ in range(count)]
        self.counts = [label_items(batch, self.shifts) for _, batch in fetched]
        self.total = None
        if self.countable and all(count is not None for count in self.counts):
            local = torch.stack([count for count in self.counts if count is not None]).sum().float()
            self.total = accelerator.reduce(local.to(accelerator.device), reduction="sum") / copies
        return iter(fetched)

    def forward_of(self, index: int) -> None:
        """The next training forward is micro-batch `index`'s; None after it (evaluation passes nothing)."""
        self.current, self.passed = index, False

    def exact(self, output: LossOutput) -> LossOutput:
        """The micro-batch's loss as a sum over its items, when its forward was given the step's total."""
        index, self.current = self.current, None
        if not self.passed or output.num_items is not None or index is None:
            return output
        items, total = self.counts[index], self.total
        assert items is not None and total is not None  # passed only with both
        terms = {name: term if name in output.counts else term * items for name, term in output.terms.items()}
        return LossOutput(output.loss * total, items, terms, output.counts)

    def _pass_total(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        if self.current is None or ("labels" not in kwargs and "shift_labels" not in kwargs):
            return None
        if self.total is None:
            if self.warn:
                warnings.warn(
                    "accel-trainer: the model computes its own loss from labels, a mean over each micro-batch, and"
                    " the batches carry no 'labels' to count before the forward (or the layout slices them), so"
                    f" under accumulation or several processes its loss is not the step's: {_FIX}",
                    stacklevel=2,
                )
                self.warn = False
            return None
        if not self.checked:
            self._check_labels(kwargs)
        self.passed = True
        return args, {**kwargs, "num_items_in_batch": self.total}

    def _check_labels(self, kwargs: dict[str, Any]) -> None:
        """The labels the recipe passed must count what the batch's did (one read-back, on the first step)."""
        seen = label_items(kwargs, self.shifts)
        counted = self.counts[self.current or 0]
        if seen is not None and counted is not None and int(seen) != int(counted):
            raise RecipeError(
                f"compute_loss passed the model labels with {int(seen)} items, but the batch's 'labels' have"
                f" {int(counted)}: pass the batch's labels, or {_FIX}"
            )
        self.checked = True


def label_items(batch: Any, shifts: bool) -> torch.Tensor | None:
    """The items a transformers loss counts in a batch: `shift_labels`, or `labels` (shifted for a causal LM),
    that are not IGNORE_INDEX; None without either."""
    if not isinstance(batch, Mapping):
        return None
    if isinstance(batch.get("shift_labels"), torch.Tensor):
        return batch["shift_labels"].ne(IGNORE_INDEX).sum()
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor):
        return None
    return (labels[..., 1:] if shifts else labels).ne(IGNORE_INDEX).sum()


def model_items(model: torch.nn.Module, countable: bool, warn: bool) -> ModelItems | None:
    """A ModelItems for a transformers model whose forward accepts `num_items_in_batch`; None for any other.

    `countable`: whether the layout lets a count be made before the forward (not a pipeline or
    context-parallel layout); `warn`: whether to warn when it cannot (several micro-batches or processes).
    """
    if not hasattr(model, "loss_function"):  # not a transformers PreTrainedModel
        return None
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        parameters = inspect.signature(model.forward).parameters.values()
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD or p.name == "num_items_in_batch" for p in parameters)
    if not accepts:
        return None
    return ModelItems(model, shifts=_loss_shifts_labels(model), countable=countable, warn=warn)


def _loss_shifts_labels(model: Any) -> bool:
    """Whether the model's loss shifts its labels (a causal LM's): the loss function transformers picks for it
    (its `loss_type`, else ForCausalLMLoss, as `PreTrainedModel.loss_function` falls back), not an encoder-decoder.
    The HF Trainer asks LOSS_MAPPING for the type alone, and so counts position 0 for a GPT2LMHeadModel, whose
    class name gives no loss type."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    function = getattr(model, "_loss_function", None) or LOSS_MAPPING.get(
        getattr(model, "loss_type", None) or "", ForCausalLMLoss
    )
    is_encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return function is ForCausalLMLoss and not is_encoder_decoder
