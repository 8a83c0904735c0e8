"""Where a recipe's model is cut into pipeline stages, and what each process keeps of it.

Split points come from the recipe: `pipeline_split = ("blocks.2", ...)` names the modules that begin a new
stage; without it, the `wrap_classes` blocks are spread evenly over the stages, the modules before the first
block (embeddings) and after the last (final norm, head) counting as one block each, so a model of n blocks
takes up to n + 1 stages (the output layers always share the last block's stage). With S stages over P
processes (S = P, or 2P for the looped schedules), process p holds stages p, p + P, ...

The model is traced and split by torch's `pipeline()` (torch.export), whose stage modules keep the model's
own Parameter objects and names. Each process keeps a *local view* of the model: the same module tree with
only the parameters and buffers of its stages, which the optimizer, checkpoints and state dicts see, under
the names a one-process run uses.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from accel_trainer.errors import ConfigError
from accel_trainer.parallel.wrapping import block_classes


def split_spec(model: nn.Module, recipe: Any, num_stages: int) -> dict[str, SplitPoint]:
    """The module boundaries at which stages 1..num_stages-1 begin, for torch's `pipeline()`.

    Raises:
        ConfigError: a `pipeline_split` naming unknown modules or the wrong number of them, a recipe with
            neither `pipeline_split` nor `wrap_classes`, or fewer units than stages.
    """
    names = dict(model.named_modules())
    declared = tuple(getattr(recipe, "pipeline_split", ()) or ())
    if declared:
        unknown = [name for name in declared if name not in names]
        if unknown:
            raise ConfigError(f"pipeline_split names {unknown[0]!r}, which is not a module of {type(model).__name__}")
        if len(declared) != num_stages - 1:
            raise ConfigError(
                f"pipeline_split names {len(declared)} boundaries, but this layout has {num_stages} pipeline"
                f" stages: name {num_stages - 1}, or drop pipeline_split to spread the wrap_classes blocks"
            )
        return dict.fromkeys(declared, SplitPoint.BEGINNING)
    blocks = outermost_blocks(model, block_classes(recipe, model))
    if not blocks:
        raise ConfigError(
            f"pipeline parallelism needs to know where {type(model).__name__} can be cut: give the recipe"
            " wrap_classes (its repeated blocks) or pipeline_split = (module names that begin a stage)"
        )
    units = len(blocks) + 2  # what comes before the first block, the blocks, what comes after the last
    if num_stages >= units:  # torch marks one split per module: a stage of the output layers alone has none
        raise ConfigError(
            f"{type(model).__name__} has {len(blocks)} blocks, too few for {num_stages} pipeline stages (at most"
            f" {units - 1}): use fewer stages, a deeper model, or pipeline_split"
        )
    # Stage k begins at unit k * units // num_stages, which is a block (1..len(blocks)) when num_stages < units.
    return {blocks[stage * units // num_stages - 1]: SplitPoint.BEGINNING for stage in range(1, num_stages)}


def traced_pipeline(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], spec: dict[str, SplitPoint]
) -> Any:
    """torch's `pipeline()` of `model` on example inputs, leaving the model as it found it.

    `pipeline()` marks the split points by replacing each named module's `forward` and never puts it back
    (torch 2.13), so a second trace (new shapes) wraps the wrapper and recurses without end; the marks are
    removed here after each trace (canary: test_pipeline.py).
    """
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")  # dumps the graph of a failed trace
    level = shapes_log.level
    try:
        shapes_log.setLevel(logging.ERROR)
        # torch.export's own deprecation notice (once per trace), and the graph it prints when a trace fails
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            return pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=spec)
    except RuntimeError as error:
        if "capture your model as a full graph" not in str(error):
            raise
        cause = error.__cause__ or error
        raise ConfigError(
            f"torch could not trace {type(model).__name__} into one graph for the pipeline"
            f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]}): its forward must not branch on"
            " tensor values (docs/layouts.md, pipeline parallelism)"
        ) from None
    finally:
        shapes_log.setLevel(level)
        for name in spec:
            module = model.get_submodule(name)
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_orig_forward", None)


def outermost_blocks(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[str]:
    """Names of the modules of `classes` that are not inside another one, in registration order."""
    blocks: list[str] = []
    if not classes:
        return blocks
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(name.startswith(block + ".") for block in blocks):
            blocks.append(name)
    return blocks


def stages_of_process(process: int, num_processes: int, num_stages: int) -> list[int]:
    """The stages a process runs: one, or every num_processes-th for the looped schedules."""
    return list(range(process, num_stages, num_processes))


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names sharing one tensor, in the model's registration order (the first name is the
    one a one-process run's optimizer and checkpoints use)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def local_view(model: nn.Module, kept: set[str]) -> nn.Module:
    """The model's module tree sharing its tensors, with only the parameters and buffers named in `kept`."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    view = copy.deepcopy(model, memo=shared)
    for name, _ in list(view.named_parameters(remove_duplicate=False)):
        if name not in kept:
            _unregister(view, name, "_parameters")
    for name, _ in list(view.named_buffers(remove_duplicate=False)):
        if name not in kept:
            _unregister(view, name, "_buffers")
    return view


def _unregister(model: nn.Module, name: str, registry: str) -> None:
    owner, _, attribute = name.rpartition(".")
    getattr(model.get_submodule(owner), registry).pop(attribute, None)


def share_model_parameters(stage_module: nn.Module, model: nn.Module) -> None:
    """Make a traced stage use the model's own parameters and buffers: `pipeline()` gives each stage a copy of
    a weight several stages use (tied weights), which would leave the optimizer's parameter without gradients,
    and a later trace (new shapes) must update the same running statistics as the first."""
    own = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    held = [*stage_module.named_parameters(remove_duplicate=False), *stage_module.named_buffers(remove_duplicate=False)]
    for name, tensor in held:
        if own.get(name, tensor) is not tensor:
            owner, _, attribute = name.rpartition(".")
            setattr(stage_module.get_submodule(owner), attribute, own[name])


def stage_tensor_names(stage_module: nn.Module) -> set[str]:
    """The parameter and buffer names a traced stage module holds (the model's own names)."""
    return {name for name, _ in stage_module.named_parameters(remove_duplicate=False)} | {
        name for name, _ in stage_module.named_buffers(remove_duplicate=False)
    }


def first_chunk(values: Any, num_chunks: int) -> Any:
    """The first of `num_chunks` equal row slices of every tensor in `values` (the schedule's micro-batch)."""
    if isinstance(values, torch.Tensor):
        return values[: values.shape[0] // num_chunks] if values.ndim else values
    if isinstance(values, dict):
        return {key: first_chunk(value, num_chunks) for key, value in values.items()}
    if isinstance(values, (tuple, list)):
        return type(values)(first_chunk(value, num_chunks) for value in values)
    return values
