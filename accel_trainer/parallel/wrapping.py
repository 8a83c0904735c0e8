"""Per-block model preparation from the recipe's `wrap_classes`: FSDP units and activation checkpointing.

A recipe names its repeated blocks once (`wrap_classes = (Block,)`); this module turns that into what each
layout needs before `accelerator.prepare`:
- FSDP: accelerate's transformer wrap policy reads `model._no_split_modules` (the transformers convention),
  so each block becomes its own FSDP unit whose parameters are gathered only while it runs. A layout that
  names classes itself (`fsdp_transformer_layer_cls_to_wrap`) takes precedence.
- Activation checkpointing: each block is wrapped in torch's non-reentrant `checkpoint_wrapper`, which works
  under DDP (the reentrant variant breaks DDP's gradient hooks) and under FSDP2 (accelerate's FSDP2 wrap
  policy looks through the wrapper), with one code path for every layout. A transformers model uses its
  own `gradient_checkpointing_enable()` (non-reentrant too) and `use_cache=False`: wrapping its blocks from
  outside crashed on the key-value cache it then returns.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from accel_trainer.recipe import Recipe


def prepare_blocks(
    model: torch.nn.Module, recipe: Recipe, activation_checkpointing: bool, *, is_main_process: bool
) -> None:
    """Mark the recipe's blocks as FSDP units and, if asked, checkpoint their activations (in place)."""
    classes = tuple(recipe.wrap_classes)
    present = [cls.__name__ for cls in classes if any(isinstance(module, cls) for module in model.modules())]
    if present:  # accelerate refuses a class the model lacks (a GPT of n_layer=0): that one model is one unit
        model._no_split_modules = present  # type: ignore[assignment]
    if not activation_checkpointing:
        return
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
        model.config.use_cache = False  # type: ignore[union-attr]
        return
    if not classes:
        if is_main_process:
            warnings.warn(
                f"accel-trainer: activation_checkpointing has no effect: {type(recipe).__name__} names no"
                " wrap_classes to checkpoint",
                stacklevel=2,
            )
        return
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: isinstance(module, classes),
    )
