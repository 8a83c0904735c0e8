"""The recipe's calls as a pipeline sees them: which inputs `compute_loss` gives the model (recorded once, to
trace the stages and to slice micro-batches), and the last stage's output standing in for the whole model when
the recipe computes its loss and eval metrics there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accel_trainer.errors import RecipeError


class _Called(Exception):
    """Raised by the input-recording stand-in: the arguments the recipe calls its model with."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("model called")
        self.args, self.kwargs = args, kwargs


class _InputRecorder(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Called(args, kwargs)


class StageOutput(nn.Module):
    """The model as the recipe's loss sees it on the last stage: it returns what the last stage computed."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output, self.calls = output, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1:  # a second call would silently get the first call's output
            raise RecipeError("the recipe calls its model more than once per batch, which a pipeline cannot run")
        return self.output


def model_inputs(recipe_function: Any, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments `recipe_function(model, batch)` calls its model with."""
    try:
        recipe_function(_InputRecorder(), batch)
    except _Called as called:
        return called.args, called.kwargs
    raise RecipeError(f"{recipe_function.__name__} never called the model, so a pipeline cannot feed it")


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.ndim:
            return int(value.shape[0])
    raise RecipeError("the model's inputs hold no tensor with a batch dimension, so a pipeline cannot slice them")
