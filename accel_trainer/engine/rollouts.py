"""A recipe's `rollout` (accel_trainer/recipe.py) run on an optimizer step's micro-batches before their forwards, or
on several steps' at the first step of a generation that feeds them (`rollout_schedule`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from accel_trainer.checkpoint.generations import Generations
from accel_trainer.errors import RecipeError
from accel_trainer.observe.breadcrumb import note_where
from accel_trainer.parallel.sharding import fsdp_root_initialized


def rolled_out(
    rollout: Callable[[Any, list[Any], int], list[Any]],
    accelerator: Accelerator,
    model: Any,
    fetched: list[tuple[int, Any]],
    step: int,
) -> Iterator[tuple[int, Any]]:
    """The step's `fetched` (epoch, micro-batch) pairs with each micro-batch the rollout made of it, as the step
    then reads them. The rollout sees the model without DDP's wrapper (its forwards need no gradient
    synchronisation) and without gradients; the model's mode is put back after it."""
    note_where("the rollout of step", step)
    training, unwrapped = model.training, accelerator.unwrap_model(model, keep_torch_compile=False)
    with torch.no_grad(), root_gathered(unwrapped):
        made = rollout(unwrapped, [batch for _, batch in fetched], step)
    model.train(training)
    if not isinstance(made, list) or len(made) != len(fetched):
        got = f"{len(made)} micro-batches" if isinstance(made, list) else type(made).__name__
        raise RecipeError(f"rollout returned {got} for the step's {len(fetched)}: return one for each, in a list")
    return iter([(epoch, batch) for (epoch, _), batch in zip(fetched, made, strict=True)])


def step_share(
    rollout: Callable[[Any, list[Any], int], list[Any]],
    generations: Generations,
    accelerator: Accelerator,
    model: Any,
    fetch: Callable[[int], list[tuple[int, Any]]],
    step: int,
) -> Iterator[tuple[int, Any]]:
    """Step `step`'s micro-batches: its share of the generation that feeds it (checkpoint/generations.py), rolled
    out now, from `fetch(count)`'s micro-batches, where the step is the generation's first."""

    def roll(fetched: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        return list(rolled_out(rollout, accelerator, model, fetched, step))

    share = generations.micro_batches(step, fetch, roll)  # made on the host, or restored there from a checkpoint
    return iter([(epoch, send_to_device(batch, accelerator.device)) for epoch, batch in share])


@contextlib.contextmanager
def root_gathered(model: Any) -> Iterator[None]:
    """An FSDP2 model's root ready for forwards that do not start at it (a rollout's `generate`): its state
    initialised (parallel/sharding.py) and its own parameters gathered for the rollout (`unshard`, not recursive:
    the blocks gather theirs in their forwards)."""
    if not fsdp_root_initialized(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
