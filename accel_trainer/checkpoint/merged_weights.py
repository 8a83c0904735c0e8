"""A LoRA run's merged `final/model.safetensors`, written one weight at a time.

final/ holds the base with the adapter merged (it loads as a plain transformers model). peft's
`merge_and_unload` merges every adapted layer at once, and as the weights it merges into are the trained model's
(final_weights.model_holding), into copies: every adapted weight held twice, and for QLoRA every 4-bit weight
beside its full-precision form. That was each adapter run's whole-process peak: SmolLM2-135M, LoRA r=8 on every
linear layer, float32, on tcmalloc: 1,221 MiB while training, 1,586 MiB while writing final/ (QLoRA: 907 and
1,239). Here each adapted layer is merged alone, by peft's own `merge`, into a copy of its weight (a 4-bit one
dequantized first), written, and let go: the save holds one merged weight at a time.

safetensors writes a dict of tensors held at once (`save_file`), so the file is laid out here as its format
says (an 8-byte little-endian header length, a JSON header of names, dtypes, shapes and byte offsets, then the
bytes), with the library's own dtype names (`safetensors.torch.save` of an empty tensor of each dtype) and each
tensor's bytes as safetensors writes them on a little-endian machine. config.json and generation_config.json are
transformers' own (`save_pretrained` with no weights). Where a model holds more than LoRA layers on linear or
`Conv1D` weights (modules_to_save, DoRA, other tuners) or transformers converts its weights' names when saving
(`revert_weight_conversion`), `streamable` says no and the whole model is merged as before.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch

from accel_trainer.contract.quantization import dequantize, is_quantized

LORA_PREFIX = "lora_"
"""peft's LoRA parameters and modules are named lora_A, lora_B, lora_embedding_A, lora_magnitude_vector, ..."""


def streamable(model: Any) -> bool:
    """Whether `model` (a peft model) can be written merged one weight at a time: plain LoRA layers only, and no
    renaming of weights on transformers' save."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model()
    for module in base.modules():
        if isinstance(module, ModulesToSaveWrapper):
            return False
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer):
            return False
        if isinstance(module, LoraLayer) and (
            any(module.use_dora.values()) or module.lora_embedding_A or not hasattr(module.get_base_layer(), "weight")
        ):
            return False
    return not _renamed_on_save(base)


def _renamed_on_save(base: Any) -> bool:
    """Whether transformers renames or converts this model's weights when it saves them (v5's weight conversions)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before its weight conversions: nothing renamed
        return False
    probe = {name: torch.empty(0, device="meta") for name, _ in _merged_names(base)}
    return revert_weight_conversion(base, probe) is not probe


def write_merged(model: Any, path: Path, left_out: set[str]) -> None:
    """Write `model` (a peft model, `streamable`) with its adapter merged into safetensors file `path`, one
    weight made at a time; the names in `left_out` (tied weights its config ties again) are not written."""
    entries = [(name, make) for name, make in _merged_tensors(model.get_base_model()) if name not in left_out]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, make in entries:
        tensor = make(False)
        size = tensor.numel() * tensor.element_size()
        shape, span = list(tensor.shape), [offset, offset + size]
        header[name] = {"dtype": _dtype_name(tensor.dtype), "shape": shape, "data_offsets": span}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, make in entries:
            tensor = make(True).contiguous()
            expected = header[name]
            if list(tensor.shape) != expected["shape"] or _dtype_name(tensor.dtype) != expected["dtype"]:
                raise RuntimeError(f"{name}: merged as {tuple(tensor.shape)} {tensor.dtype}, planned otherwise")
            file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
    os.replace(partial, path)


def _merged_names(base: Any) -> Iterator[tuple[str, str]]:
    """(name in the merged model, name in `base`) for each entry of `base`'s state dict the merge keeps: peft's
    own parameters dropped, `.base_layer` taken out of the names of the layers they adapt."""
    for name in base.state_dict(keep_vars=True):
        parts = name.split(".")
        if not any(part.startswith(LORA_PREFIX) for part in parts):
            yield ".".join(part for part in parts if part != "base_layer"), name


def _merged_tensors(base: Any) -> Iterator[tuple[str, Callable[[bool], torch.Tensor]]]:
    """Each merged model's name with a function giving its tensor: `make(True)` the merged weight (or the kept
    tensor), `make(False)` a tensor of the same shape and dtype, cheap (the base weight as it is, or its logical
    shape and dtype)."""
    from peft.tuners.lora import LoraLayer

    state = base.state_dict(keep_vars=True)
    adapted = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    for merged_name, name in _merged_names(base):
        owner, _, leaf = name.rpartition(".")
        layer = adapted.get(owner.removesuffix(".base_layer")) if owner.endswith("base_layer") else None
        if layer is not None and leaf == "weight":
            yield merged_name, _merging(layer, state[name])
        else:
            yield merged_name, _kept(state[name])


def _kept(tensor: Any) -> Callable[[bool], torch.Tensor]:
    """A tensor the merge keeps; a 4-bit one (no adapter on it) as the full-precision values it stands for."""
    if not is_quantized(tensor):
        return lambda full: tensor.detach()
    return lambda full: (
        tensor.get_original_weight() if full else torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    )


def _merging(layer: Any, weight: torch.Tensor) -> Callable[[bool], torch.Tensor]:
    def make(full: bool) -> torch.Tensor:
        return merged_weight(layer) if full else torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    return make


def merged_weight(layer: Any) -> torch.Tensor:
    """LoRA layer `layer`'s weight with its adapter merged by peft's `merge`, into a copy (a 4-bit weight
    dequantized); the layer is left as it was."""
    base = layer.get_base_layer()
    weight, kind = base.weight, type(base)
    dequantize(base)  # a 4-bit weight: its full-precision values, a new tensor; another weight: as it is
    if base.weight is weight:
        base.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    try:
        layer.merge()
        return base.weight.detach()
    finally:
        layer.merged_adapters.clear()
        base.weight, base.__class__ = weight, kind


@cache
def _dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of `dtype` (F32, BF16, ...), read from the header it writes for an empty tensor."""
    from safetensors.torch import save

    encoded = save({"t": torch.empty(0, dtype=dtype)})
    (length,) = struct.unpack("<Q", encoded[:8])
    return str(json.loads(encoded[8 : 8 + length])["t"]["dtype"])
