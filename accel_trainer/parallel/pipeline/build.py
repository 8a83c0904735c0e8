"""A run's pipeline: the layout options a pipeline cannot take yet, refused in one line, then this process's
stages (stages.py), traced on the shapes of a first micro-batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from accelerate import Accelerator
from torch.distributed.fsdp import CPUOffloadPolicy

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.errors import LayoutError
from accel_trainer.parallel.pipeline.stages import Pipeline
from accel_trainer.parallel.wrapping import block_classes
from accel_trainer.recipe import Recipe


def build_pipeline(
    recipe: Recipe,
    model: Any,
    first_examples: Callable[[], list[Any]],
    accumulation_steps: int,
    layout: LayoutSettings,
    accelerator: Accelerator,
) -> Pipeline:
    """Cut the model into this process's stages, traced on the shapes of a first micro-batch (`first_examples`
    gives its rows).

    Raises:
        LayoutError: an EMA, sync_batchnorm, fp16 or offloaded parameters, which a pipeline does not run yet, or
            a transformers model.
    """
    _refuse_transformers(model)
    if recipe.cfg.ema_decay:
        raise LayoutError(
            "a pipeline layout does not keep an EMA of the weights yet: set ema_decay=0, or train on a"
            " data-parallel, FSDP or tensor-parallel layout"
        )
    if layout.sync_batchnorm or accelerator.mixed_precision == "fp16":
        raise LayoutError(
            "a pipeline layout does not combine with sync_batchnorm or fp16 yet (fp16's"
            " loss scaler is not wired into the schedules): turn them off, or use mixed_precision=bf16"
        )
    if layout.activation_checkpointing and not block_classes(recipe, model) and accelerator.is_main_process:
        warnings.warn(
            f"accel-trainer: activation_checkpointing has no effect: {type(recipe).__name__} names no"
            " wrap_classes to checkpoint",
            stacklevel=3,
        )
    sample = first_examples()
    fsdp = accelerator.state.fsdp_plugin if accelerator.is_fsdp2 else None
    if fsdp is not None and isinstance(fsdp.cpu_offload, CPUOffloadPolicy):
        raise LayoutError("a pipeline layout does not offload parameters yet: set fsdp_offload_params: false")
    return Pipeline(
        recipe,
        model,
        recipe.collate(sample),
        schedule=layout.pp_schedule,
        microbatches=layout.pp_microbatches,
        accumulation_steps=accumulation_steps,
        device=accelerator.device,
        autocast=accelerator.autocast,
        mesh=accelerator.torch_device_mesh,
        reshard_after_forward=bool(fsdp is not None and fsdp.reshard_after_forward),
        activation_checkpointing=layout.activation_checkpointing,
    )


def _refuse_transformers(model: Any) -> None:
    """Refuse a transformers `PreTrainedModel`, also inside a peft wrapper (peft's `get_base_model`; found by module
    name: transformers is optional): its forward returns a cache and an output object, and takes keyword tensors,
    which torch's schedules hand to every stage."""
    inner = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    if any(cls.__module__.startswith("transformers.") for cls in type(inner).__mro__):
        raise LayoutError(
            f"a pipeline layout does not run transformers models ({type(model).__name__}) yet: torch's traced stages"
            " pass tensors, not the cache and output objects their forward returns; use an FSDP layout"
        )
