"""Whether `compute_loss` called the prepared model itself, checked for every training micro-batch.

Under DDP only the wrapper's own forward sets up the gradient all-reduce: a loss computed through a
submodule (`model.module.generator(z)`, `model.encoder(x)` on an unwrapped view) trains each process on its
own gradients without a word, and the processes drift apart (docs/accelerate-traps.md). The check runs on
every layout, so a recipe that would go wrong under DDP fails in one line on one process first.
"""

from __future__ import annotations

from typing import Any

from accel_trainer.errors import RecipeError


class ModelCalls:
    """Counts the calls of the prepared model (a forward pre-hook: about a microsecond per forward)."""

    def __init__(self, model: Any):
        self.count = 0
        model.register_forward_pre_hook(self._called)

    def _called(self, module: Any, args: Any) -> None:
        self.count += 1

    def check_called_since(self, before: int, phase: str | None) -> None:
        """Raise a one-line RecipeError when the model was not called since the count was `before`."""
        if self.count == before:
            where = "compute_loss" if phase is None else f"compute_loss(phase={phase!r})"
            raise RecipeError(
                f"{where} never called model(...): call the model it is given (its forward may dispatch to"
                " a submodule), not a submodule or model.module; under DDP only the model's own forward"
                " averages the gradients over the processes"
            )
