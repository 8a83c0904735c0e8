"""Tensor and sequence parallelism from a recipe's `tp_plan`, applied with torch's `parallelize_module`.

A recipe names modules and styles, never processes (transformers' style names):

    tp_plan = {"blocks.*.attention.q": "colwise", "blocks.*.attention.proj": "rowwise", ...}

Keys are module names in which `*` stands for one component (a block's index). A transformers model's own
plan (`base_model_tp_plan`) is the default for a recipe without one (`from_transformers_plan`). Styles:
- "colwise": the layer's output features are split (an nn.Linear's weight rows and bias); its output stays
  split along the last dimension, which the next "rowwise" layer takes as its input;
- "rowwise": the input features are split and the partial outputs summed over the tensor-parallel ranks;
- "colwise_gather_output": "colwise" with the output gathered whole (an LM head whose logits the loss needs);
- "embedding": an nn.Embedding split along its rows (the vocabulary), the partial lookups summed;
- "sequence_parallel": a norm (LayerNorm, RMSNorm) run on the activations' shard of the sequence.
With any "sequence_parallel" entry the activations between split layers are sharded along dimension 1 (the
sequence) instead of replicated: "colwise" layers gather them, "rowwise" layers and embeddings reduce-scatter
into them (Megatron-LM's sequence parallelism). Batches must then have sequence lengths divisible by
tp_size (checked before each forward), and every module with parameters needs an entry.

After splitting, weights the model had tied (an LM head and its token embedding) are tied again:
`parallelize_module` replaces each with its own DTensor. Without sequence parallelism, modules the plan
leaves alone get replicated DTensor parameters (torch's `distribute_module`), so that gradient clipping sees
one kind of tensor on one mesh (with plain tensors beside DTensors `clip_grad_norm_` fails).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from accel_trainer.errors import ConfigError

STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding", "sequence_parallel")
# transformers' style names (`base_model_tp_plan`) that mean one of ours
TRANSFORMERS_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "embedding_rowwise": "embedding",
}


def from_transformers_plan(plan: dict[str, str]) -> dict[str, str]:
    """A transformers model's tp_plan in this module's styles.

    Raises:
        ConfigError: a style with no counterpart here (packed, local or expert-parallel styles).
    """
    unknown = sorted({style for style in plan.values() if style not in TRANSFORMERS_STYLES})
    if unknown:
        raise ConfigError(
            f"the model's own tp_plan (transformers' base_model_tp_plan) uses {', '.join(map(repr, unknown))}, which"
            " accel-trainer does not split: write the recipe's tp_plan = {module pattern: style} (docs/layouts.md)"
        )
    return {name: TRANSFORMERS_STYLES[style] for name, style in plan.items()}


def check_tp_plan(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, style) for every module the plan names, checked on every layout, so that a plan
    written on one process fails on the first run rather than on the first tensor-parallel launch.

    Raises:
        ConfigError: an unknown style, an entry matching no module, or (under sequence parallelism) a module
            with parameters that no entry names.
    """
    matches = _matches(model, plan)
    for _, _, style in matches:
        if style not in STYLES:
            raise ConfigError(f"tp_plan style {style!r} is not one of {', '.join(STYLES)}")
    if "sequence_parallel" in plan.values():
        named = {name for name, _, _ in matches}
        for name, module in model.named_modules():
            if name not in named and any(True for _ in module.parameters(recurse=False)):
                raise _unplanned(name, module)
    return matches


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], mesh: DeviceMesh) -> None:
    """Split `model` in place over the 1-D tensor-parallel `mesh` as `plan` says.

    Raises:
        ConfigError: an empty plan, anything check_tp_plan refuses, or tied weights split two different ways.
    """
    if not plan:
        raise ConfigError(
            f"this layout is tensor parallel (tp_size={mesh.size()}) but the recipe has no tp_plan: add a class"
            " attribute tp_plan = {module pattern: style} (docs/layouts.md), or launch a layout without tp_size"
        )
    check_heads_split(model, mesh.size())
    sequence_parallel = "sequence_parallel" in plan.values()
    tied = _tied_parameters(model)
    styles = {name: _style(style, module, sequence_parallel) for name, module, style in check_tp_plan(model, plan)}
    parallelize_module(model, mesh, styles)  # type: ignore[arg-type]
    _tie_again(model, tied)
    leftovers = [name for name, module in model.named_modules() if _has_plain_parameters(module)]
    if leftovers and sequence_parallel:  # a style that leaves some of its module's parameters plain
        raise _unplanned(leftovers[0], model.get_submodule(leftovers[0]))
    for name in leftovers:
        _replicate(model.get_submodule(name), mesh)
    if sequence_parallel:
        model.register_forward_pre_hook(_check_sequence_lengths(mesh.size()), with_kwargs=True)
    # accelerate's prepare checks the model's tp_size on a tensor-parallel layout without FSDP; a transformers
    # model keeps it behind a read-only property
    size_field = "_tp_size" if isinstance(getattr(type(model), "tp_size", None), property) else "tp_size"
    setattr(model, size_field, mesh.size())


HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "num_kv_heads", "n_kv_heads")
"""The attribute names of a head count, on a transformers config or on a recipe's attention module."""


def check_heads_split(model: nn.Module, tp_size: int) -> None:
    """Refuse, in one line and before any forward, head counts tensor parallelism cannot split: a colwise q, k and v
    give each process whole heads only where tp_size divides every head count (a transformers model's config says
    them; a recipe's attention module says its own as `n_head`, `num_heads`, ...). Otherwise the first forward's
    reshape failed, which evaluation reported as its own error.

    Raises:
        ConfigError: naming the counts and tp_size.
    """
    found: dict[str, int] = {}
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for source in (module, text):
            for name in HEAD_COUNTS:
                value = getattr(source, name, None)
                if type(value) is int and value > 0:
                    found.setdefault(name, value)
    uneven = {name: value for name, value in found.items() if value % tp_size}
    if uneven:
        counts = ", ".join(f"{name}={value}" for name, value in uneven.items())
        raise ConfigError(
            f"this layout splits attention heads over tp_size={tp_size} processes, but {type(model).__name__} has"
            f" {counts}: use head counts divisible by {tp_size}, or a layout whose tp_size divides them"
        )


def _unplanned(name: str, module: nn.Module) -> ConfigError:
    if isinstance(module, nn.Embedding):
        advice = '"embedding"'
    elif isinstance(module, nn.Linear):
        advice = '"colwise", "rowwise" or "colwise_gather_output"'
    else:
        advice = '"sequence_parallel" for a norm'
    return ConfigError(
        f"tp_plan uses sequence_parallel, so every module with parameters needs an entry; {name}"
        f" ({type(module).__name__}) has none: give it {advice}"
    )


def _matches(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, style) for every module each plan entry names; each entry must name one."""
    names = dict(model.named_modules())
    found = []
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        matched = [(name, names[name], style) for name in names if name and regex.fullmatch(name)]
        if not matched:
            raise ConfigError(f"tp_plan entry {pattern!r} matches no module of {type(model).__name__}")
        found += matched
    return found


def _style(style: str, module: nn.Module, sequence_parallel: bool) -> ParallelStyle:
    between: Any = Shard(1) if sequence_parallel else Replicate()  # the activations between split layers
    if style == "embedding" or (style == "rowwise" and isinstance(module, nn.Embedding)):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if style == "colwise":
        return ColwiseParallel(input_layouts=between)
    if style == "colwise_gather_output":
        return ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel(output_layouts=between)
    if style == "sequence_parallel":
        return SequenceParallel()
    raise ConfigError(f"tp_plan style {style!r} is not one of {', '.join(STYLES)}")


def _tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (tied weights), before splitting unties them."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _tie_again(model: nn.Module, tied: list[list[str]]) -> None:
    for first, *others in tied:
        kept = model.get_parameter(first)
        for name in others:
            owner, _, attribute = name.rpartition(".")
            replaced = model.get_parameter(name)
            if isinstance(kept, DTensor) != isinstance(replaced, DTensor) or (
                isinstance(kept, DTensor) and kept.placements != replaced.placements  # type: ignore[attr-defined]
            ):
                raise ConfigError(
                    f"{first} and {name} are tied but tp_plan splits them differently: give both modules styles"
                    " that split the shared weight the same way (an embedding and a colwise head)"
                )
            setattr(model.get_submodule(owner), attribute, kept)


def _has_plain_parameters(module: nn.Module) -> bool:
    return any(not isinstance(p, DTensor) for p in module.parameters(recurse=False))


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give a module the plan left alone replicated DTensor parameters, its inputs and outputs staying plain."""

    def parameters_replicated(name: str, submodule: nn.Module, device_mesh: DeviceMesh) -> None:
        for key, parameter in list(submodule.named_parameters(recurse=False)):
            if not isinstance(parameter, DTensor):
                replicated = distribute_tensor(parameter.detach(), device_mesh, [Replicate()])
                submodule.register_parameter(key, nn.Parameter(replicated, parameter.requires_grad))

    def inputs_replicated(submodule: nn.Module, inputs: Any, device_mesh: DeviceMesh) -> Any:
        return tuple(
            DTensor.from_local(x, device_mesh, [Replicate()])
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def outputs_local(submodule: nn.Module, outputs: Any, device_mesh: DeviceMesh) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    distribute_module(module, mesh, parameters_replicated, inputs_replicated, outputs_local)  # type: ignore[arg-type]


def _check_sequence_lengths(tp_size: int) -> Any:
    """A forward pre-hook refusing batches whose sequence length sequence parallelism cannot split evenly
    (gloo aborts the process on the uneven collective: 'Received data size doesn't match expected size')."""

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] % tp_size:
                raise ConfigError(
                    f"sequence parallelism splits the sequence over tp_size={tp_size} processes, but a batch has"
                    f" length {value.shape[1]}: pad batches to a multiple of {tp_size} in the recipe's collate"
                )

    return check
