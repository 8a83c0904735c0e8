"""The model prepared for its layout: tensor parallelism, SyncBatchNorm, and per-block preparation from the
recipe's `wrap_classes` (FSDP units and activation checkpointing), in `split_and_wrap`.

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
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.contract.quantization import check_shardable, quantized_names
from accel_trainer.errors import ConfigError
from accel_trainer.parallel.batchnorm import convert_to_sync_batchnorm
from accel_trainer.parallel.mesh import describe_mesh
from accel_trainer.parallel.tensor_parallel import apply_tensor_parallel, check_tp_plan, from_transformers_plan
from accel_trainer.recipe import Recipe


def block_classes(recipe: Recipe, model: torch.nn.Module) -> tuple[type[torch.nn.Module], ...]:
    """The classes of the model's repeated blocks: the recipe's `wrap_classes`, else those a transformers model
    names in `_no_split_modules` (its decoder layers; a peft model passes its base's on)."""
    if recipe.wrap_classes:
        return tuple(recipe.wrap_classes)
    names = set(getattr(model, "_no_split_modules", None) or ())
    return tuple(dict.fromkeys(type(module) for module in model.modules() if type(module).__name__ in names))


def tp_plan_of(recipe: Recipe, model: torch.nn.Module) -> dict[str, str]:
    """The recipe's `tp_plan`, else the plan a transformers model declares (its class's and its config's
    `base_model_tp_plan`, as `model.tp_plan` gathers them with full module names) in this framework's styles. A
    peft model's plan names its base's modules, which the adapter wraps: it has none."""
    if recipe.tp_plan:
        return dict(recipe.tp_plan)
    if getattr(model, "peft_config", None):
        return {}
    declared = getattr(model, "tp_plan", None)
    return from_transformers_plan(declared) if isinstance(declared, dict) else {}


def prepare_blocks(
    model: torch.nn.Module, recipe: Recipe, activation_checkpointing: bool, *, is_main_process: bool
) -> None:
    """Mark the recipe's blocks as FSDP units and, if asked, checkpoint their activations (in place)."""
    classes = block_classes(recipe, model)
    present = [cls.__name__ for cls in classes if any(isinstance(module, cls) for module in model.modules())]
    if present:  # accelerate refuses a class the model lacks (a GPT of n_layer=0): that one model is one unit
        model._no_split_modules = present  # type: ignore[assignment]
    if not activation_checkpointing:
        return
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
        if hasattr(model, "config"):  # a PolicyAndReference turns its policy's cache off itself
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


def split_and_wrap(model: Any, recipe: Recipe, layout: LayoutSettings, accelerator: Accelerator) -> Any:
    """Tensor parallelism, SyncBatchNorm, FSDP units and activation checkpointing, as the layout asks (a 4-bit
    base refused first where it cannot train)."""
    check_four_bit_layout(accelerator, model)
    mesh = accelerator.torch_device_mesh
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        apply_tensor_parallel(model.to(accelerator.device), tp_plan_of(recipe, model), mesh["tp"])
    else:  # a plan's mistakes show on the first run, though only a tensor-parallel layout needs it right
        _warn_about_tp_plan(model, recipe, accelerator.is_main_process)
    if layout.sync_batchnorm:
        model = convert_to_sync_batchnorm(model, accelerator, accelerator.is_main_process)
    checkpointing = layout.activation_checkpointing and layout.pp_size == 1  # a pipeline checkpoints its stages
    prepare_blocks(model, recipe, checkpointing, is_main_process=accelerator.is_main_process)
    return model


def _warn_about_tp_plan(model: Any, recipe: Recipe, is_main_process: bool) -> None:
    try:
        check_tp_plan(model, tp_plan_of(recipe, model))
    except ConfigError as error:
        if is_main_process:
            warnings.warn(f"accel-trainer: {error} (it matters on a tensor-parallel layout only)", stacklevel=3)


def check_four_bit_layout(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """A 4-bit base (QLoRA) trains on one process, DDP, FSDP2 and HSDP; elsewhere, or on a shard count its
    weights do not split over, a one-line refusal before any wrapping."""
    if not quantized_names(model):
        return
    config = accelerator.parallelism_config
    if config is not None and (config.tp_size > 1 or config.cp_size > 1 or getattr(config, "pp_size", 1) > 1):
        raise ConfigError(
            f"quantize_base=nf4 trains on one process, DDP, FSDP2 and HSDP, not on this layout's mesh"
            f" ({describe_mesh(accelerator)}): use one of those layouts"
        )
    if accelerator.distributed_type == DistributedType.FSDP:
        check_shardable(model, config.dp_shard_size if config is not None else accelerator.num_processes)
