"""FSDP's RAM-efficient loading: a pretrained base is read by the main process alone.

With `fsdp_cpu_ram_efficient_loading: true` in an FSDP layout, accelerate's FSDP2 preparation moves the model to
the meta device, shards it, and broadcasts the main process's weights into every shard. transformers 5 no longer
spares the other processes the reading (each `from_pretrained` reads and holds the whole base), so this module
does: the main process builds the recipe's model first; where that model was loaded from a pretrained base
(transformers or peft: `pretrained.base_source`) and can tie its weights again (`tie_weights()`), the others build it
under accelerate's `init_empty_weights`, which reads no weight and allocates none. Their trainable parameters get
uninitialised memory (accelerate maps the optimizer's parameters to the shards by their storage, which meta
tensors share), so a LoRA run allocates only its adapter there and a full fine-tune the trainable weights, never
read from disk. Any other model is built by every process as usual; one that ties weights without
`tie_weights()` loads on every process (launch_fixes: the broadcast would untie it).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator, init_empty_weights
from accelerate.utils import broadcast_object_list, set_module_tensor_to_device

from accel_trainer.errors import RecipeError
from accel_trainer.parallel import launch_fixes
from accel_trainer.pretrained import base_source
from accel_trainer.recipe import Recipe

READ_ONCE, EVERY_PROCESS, FAILED = "read by the main process", "built by every process", "failed"


def build_model(recipe: Recipe, cfg: Any, accelerator: Accelerator) -> torch.nn.Module:
    """The recipe's model, built for the layout's way of loading (see the module's docstring)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or not plugin.cpu_ram_efficient_loading or accelerator.num_processes == 1:
        return recipe.build_model(cfg)
    model: torch.nn.Module | None = None
    way: list[str | None] = [None]
    if accelerator.is_main_process:
        try:
            model = recipe.build_model(cfg)
        except BaseException:
            broadcast_object_list([FAILED])  # the others stop too (the main process says why)
            raise
        way = [loading_way(model)]
    broadcast_object_list(way)  # the others wait here while the main process builds
    if way[0] == FAILED:
        raise RecipeError("the main process could not build the recipe's model (its error says why)")
    if model is None and way[0] == READ_ONCE:
        with init_empty_weights(include_buffers=False):
            model = recipe.build_model(cfg)
        materialise_trainable_parameters(model)
    elif model is None:
        model = recipe.build_model(cfg)
    launch_fixes.load_weights_on_every_process_if_ties_need_it(plugin, model)
    return model


def loading_way(model: torch.nn.Module) -> str:
    """READ_ONCE for a pretrained transformers or peft model that can tie its weights again, else EVERY_PROCESS."""
    return READ_ONCE if base_source(model) and hasattr(model, "tie_weights") else EVERY_PROCESS


def materialise_trainable_parameters(model: torch.nn.Module) -> None:
    """Give the trainable parameters left on the meta device uninitialised CPU memory (the broadcast fills them),
    and tie the model's weights again (a tied parameter was replaced under one of its names)."""
    for name, parameter in list(model.named_parameters()):
        if parameter.requires_grad and parameter.is_meta:
            value = torch.empty(parameter.shape, dtype=parameter.dtype)
            set_module_tensor_to_device(model, name, "cpu", value=value)
    model.tie_weights()  # type: ignore[operator]  # a transformers or peft model's (loading_way)
