"""FSDP's RAM-efficient loading: a pretrained base is read and kept by the main process alone.

With `fsdp_cpu_ram_efficient_loading: true` in an FSDP layout, accelerate's FSDP2 preparation moves the model to
the meta device, shards it, and broadcasts the main process's weights into every shard. transformers 5 no longer
spares the other processes (each `from_pretrained` loads and holds the whole base), so this module does: the main
process builds the recipe's model first; where that model was loaded from a pretrained base (transformers or
peft: `pretrained.base_source`) and FSDP's broadcast keeps it whole (launch_fixes.broadcastable), the others build
it under accelerate's `init_empty_weights`, which keeps no weight: their frozen parameters stay on the meta device
and their trainable ones get uninitialised memory (accelerate maps the optimizer's parameters to the shards by
their storage, which meta tensors share), so a LoRA run's other processes hold its adapter alone until the
broadcast, and they read nothing of the base's files but their headers (`weights_unread`; a base read through
`at.load_base_model` is built from its config there, its files not opened at all: a GGUF file was dequantized
whole by every process). Any other model (one built from scratch, or one the broadcast gets wrong:
launch_fixes.broadcastable, a 4-bit base) is built and loaded by every process, the setting turned off for it,
as on one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator, init_empty_weights
from accelerate.utils import broadcast_object_list, patch_environment, set_module_tensor_to_device

from accel_trainer.contract.pretrained import base_source, quiet_progress_bars
from accel_trainer.contract.quantization import quantized_names
from accel_trainer.errors import RecipeError
from accel_trainer.parallel import launch_fixes
from accel_trainer.recipe import Recipe

READ_ONCE, EVERY_PROCESS, FAILED = "read by the main process", "built by every process", "failed"


def build_model(recipe: Recipe, cfg: Any, accelerator: Accelerator) -> torch.nn.Module:
    """The recipe's model, built for the layout's way of loading (see the module's docstring). transformers is
    told nothing of FSDP (FSDP_CPU_RAM_EFFICIENT_LOADING=false while building): its own non-main-process path
    still reads the weights, and leaves non-persistent buffers (rotary frequencies) as zeros for FSDP to fill."""
    quiet_progress_bars()
    with patch_environment(FSDP_CPU_RAM_EFFICIENT_LOADING="false"):
        return _built(recipe, cfg, accelerator)


def _built(recipe: Recipe, cfg: Any, accelerator: Accelerator) -> torch.nn.Module:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or not plugin.cpu_ram_efficient_loading:
        return recipe.build_model(cfg)
    if accelerator.num_processes == 1:  # nothing to spare, and accelerate's path would untie a plain model
        plugin.cpu_ram_efficient_loading = False
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
    if way[0] != READ_ONCE:  # accelerate's broadcast is for transformers models: it fails or unties others
        plugin.cpu_ram_efficient_loading = False
    if model is None and way[0] == READ_ONCE:
        with weights_unread(), init_empty_weights(include_buffers=False):
            model = recipe.build_model(cfg)
        materialise_trainable_parameters(model)
    elif model is None:
        model = recipe.build_model(cfg)
    return model


@contextlib.contextmanager
def weights_unread() -> Iterator[None]:
    """transformers 5 reads every tensor of a safetensors checkpoint while building, even one it then places on
    the meta device. Inside this block its files open through a stand-in whose slices read the header alone and
    hand out uninitialised tensors of the saved shape and dtype (measured on a 228 MB GPT-2 after dropping the
    page cache: 1 major page fault and 0.10 s, against 25 and 0.40 s without it). Canary: test_finetune.py."""
    from transformers import modeling_utils

    original = modeling_utils.safe_open
    modeling_utils.safe_open = lambda *args, **kwargs: _HeaderOnly(original(*args, **kwargs))  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        modeling_utils.safe_open = original  # type: ignore[assignment,misc]


class _HeaderOnly:
    """A safetensors file whose slices are never read (`weights_unread`)."""

    def __init__(self, opened: Any) -> None:
        self._opened = opened

    def get_slice(self, name: str) -> _UnreadSlice:
        return _UnreadSlice(self._opened.get_slice(name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._opened, name)

    def __enter__(self) -> _HeaderOnly:
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._opened.__exit__(*exc)


class _UnreadSlice:
    def __init__(self, real: Any) -> None:
        self._real = real

    def __getitem__(self, index: Any) -> torch.Tensor:
        from transformers.modeling_utils import str_to_torch_dtype

        return torch.empty(self._real.get_shape(), dtype=str_to_torch_dtype[self._real.get_dtype()])[index]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def loading_way(model: torch.nn.Module) -> str:
    """READ_ONCE for a pretrained transformers or peft model that FSDP's broadcast keeps whole, else EVERY_PROCESS
    (also for a 4-bit base: the broadcast sends plain tensors, and every process quantizes the same base alike)."""
    pretrained = base_source(model) and hasattr(model, "get_parameter_or_buffer")  # transformers' (launch_fixes)
    whole = launch_fixes.broadcastable(model) and not quantized_names(model)
    return READ_ONCE if pretrained and whole else EVERY_PROCESS


def materialise_trainable_parameters(model: torch.nn.Module) -> None:
    """Give the trainable parameters left on the meta device uninitialised CPU memory (the broadcast fills them),
    and tie the model's weights again (a tied parameter was replaced under one of its names)."""
    for name, parameter in list(model.named_parameters()):
        if parameter.requires_grad and parameter.is_meta:
            value = torch.empty(parameter.shape, dtype=parameter.dtype)
            set_module_tensor_to_device(model, name, "cpu", value=value)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # type: ignore[operator]
