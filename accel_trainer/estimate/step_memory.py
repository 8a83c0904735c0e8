"""What one process holds while it trains: its model, gradients and optimizer state, and its peak in a step.

`rank_memory` prepares the recipe's model and optimizer as a run does (`fsdp_loading.build_model`,
`split_and_wrap`, a pipeline's stages, `prepare_for_training`), then runs two optimizer steps (forward and
backward of one micro-batch of the recipe's own data, then the optimizer's step: the second step has the
optimizer's state) under torch's `MemTracker`, which counts every tensor storage that is alive, by kind. With
fake tensors (estimate/fake_world.py) nothing is allocated; with real ones, on a real launch, the same
function measures the run itself (tests/unit/estimate compare the two).

The figures, per process: the parameters, their gradients and the optimizer's state after the step (a
sharded layout's local shards, padded as FSDP pads them); the peak of all live tensors during the step; and
`activations_bytes`, the peak less those three (activations, temporaries, FSDP's gathered units, buffers).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.tensor import DTensor

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.contract.losses import read_loss_output
from accel_trainer.data import loaders
from accel_trainer.engine.build import check_optimizer_for_layout, uses_mesh
from accel_trainer.errors import ConfigError
from accel_trainer.estimate.fake_world import ddp_bucket_bytes
from accel_trainer.optim.optimizers import check_layout_for_several, read_optimizers
from accel_trainer.parallel import fsdp_loading
from accel_trainer.parallel.accelerator import prepare_for_training
from accel_trainer.parallel.context_parallel import sequence_slices
from accel_trainer.parallel.mesh import data_ranks
from accel_trainer.parallel.pipeline.build import build_pipeline
from accel_trainer.parallel.sharding import fsdp_root_initialized
from accel_trainer.parallel.wrapping import split_and_wrap
from accel_trainer.recipe import Recipe


@dataclass(frozen=True)
class RankMemory:
    """One process's memory in bytes (`--json`'s `per_rank` entries)."""

    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    peak_bytes: int
    micro_batch_size: int = 0
    """The micro-batch estimated: the recipe's default fitted to the layout's data-parallel ranks, unless set."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def first_examples(recipe: Recipe, cfg: Any) -> list[Any]:
    """The examples of a process's first training micro-batch, from the recipe's own loaders.

    Raises:
        ConfigError: micro_batch_size=auto (it is found by trying, on the devices themselves).
    """
    if cfg.micro_batch_size == "auto":
        raise ConfigError("micro_batch_size=auto is found on the devices themselves: estimate a number (16, 32, ...)")
    recipe.tokenizer = recipe.build_tokenizer(cfg)
    train_set, _ = recipe.build_datasets(cfg)
    loaders.check_dataset(train_set, "training")
    return loaders.first_examples(train_set, cfg.micro_batch_size)


def rank_memory(
    recipe: Recipe, cfg: Any, layout: LayoutSettings, accelerator: Accelerator, examples: list[Any], rank: int
) -> RankMemory:
    """This process's memory through two training steps of the micro-batch of `examples` (under fake tensors:
    estimate/fake_world.py)."""
    model, optimizer, step = prepared(recipe, cfg, layout, accelerator, examples)
    held, peak = tracked_steps(model, optimizer, step)
    buckets = ddp_bucket_bytes(model)
    held_bytes = _by_kind(held)
    params, grads, states = (held_bytes[kind] for kind in ("param", "grad", "opt"))
    total = _by_kind(peak)["total"] + buckets
    activations = total - params - grads - buckets - states
    return RankMemory(rank, params, grads + buckets, states, activations, total, len(examples))


@contextlib.contextmanager
def _no_collections() -> Iterator[None]:
    """Python's cyclic collector off while the steps are tracked: tensors a reference cycle holds (about 1.6 MB of an
    FSDP step's, the wide GPT on cpu_fsdp) were freed whenever a collection happened to run, which depends on how
    many objects the process made before (the recipe files imported): the real process's peak moved by them
    against the plan's (tests/unit/estimate/test_estimate.py). Off on both sides, both count them alike."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def tracked_steps(model: Any, optimizer: Optimizers, step: Callable[[], None]) -> tuple[dict, dict]:
    """Two training steps under torch's MemTracker: its snapshot after the second optimizer step (the gradients
    and the optimizer's state both held) and its peak. tests/workers/estimate_truth.py runs them on real tensors."""
    tracker = _LocalTensorTracker()
    tracker.track_external(model, *optimizer.optimizers)
    gc.collect()
    with tracker, _no_collections():
        for first in (True, False):
            tracker.reset_mod_stats()
            step()
            optimizer.step()
            if first:
                optimizer.zero_grad(set_to_none=True)
        return tracker.get_tracker_snapshot("current"), tracker.get_tracker_snapshot("peak")


def prepared(recipe: Recipe, cfg: Any, layout: LayoutSettings, accelerator: Accelerator, examples: list) -> tuple:
    """The model and optimizer prepared as the run prepares them, and one micro-batch's forward and backward."""
    check_layout_for_several(recipe.alternate_optimizers, cfg, uses_mesh=uses_mesh(accelerator, layout))  # as a run
    check_optimizer_for_layout(recipe, cfg, accelerator, layout)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None:  # its broadcast of the main process's weights: the same shards in the end
        plugin.cpu_ram_efficient_loading = False
    model = fsdp_loading.build_model(recipe, cfg, accelerator)
    model = split_and_wrap(model, recipe, layout, accelerator)
    ranks = data_ranks(accelerator)
    batch, pipeline = send_to_device(recipe.collate(examples), accelerator.device), None  # as the loader sends it
    if layout.pp_size > 1:
        pipeline = build_pipeline(recipe, model, lambda: examples, 1, layout, accelerator)
        model = pipeline.view
    built = read_optimizers(recipe.build_optimizer(cfg, model), recipe, model, lambda optimizer: None)
    optimizers = [phase.optimizer for phase in built.phases]
    names = [_parameter_names(model, optimizer) for optimizer in optimizers]
    model, *prepared, _, _ = prepare_for_training(accelerator, pipeline, ranks, model, *optimizers, None, None)
    inner = [getattr(optimizer, "optimizer", optimizer) for optimizer in prepared]
    for optimizer, groups in zip(inner, names, strict=True):
        _point_at(optimizer, model, groups)
    fsdp_root_initialized(model)  # FSDP pads uneven shards again at its first use: before the count starts
    if pipeline is not None:
        # The first step's handshake of the loss's terms is an object broadcast, whose sizes a fake process group
        # cannot carry (and a fake tensor cannot read): the estimate needs no loss, so it says there are none.
        pipeline._term_names, pipeline._counts_items = [], False
        return model, Optimizers(inner), functools.partial(pipeline.train, batch)
    phases: list[str | None] = [phase.name for phase in built.phases] if built.alternate else [None]
    step = functools.partial(_forward_backward, recipe, model, batch, accelerator, ranks.context_parallel, phases)
    return model, Optimizers(inner), step


def _forward_backward(
    recipe: Recipe, model: Any, batch: Any, accelerator: Accelerator, cp: int, phases: list[str | None]
) -> None:
    """As the loop's step runs a micro-batch: on a context-parallel layout, its slice of every sequence (cut in
    place: each step cuts a copy, as each of the loop's steps cuts a batch of its own); with alternating
    optimizers, each phase's loss in turn (`compute_loss(..., phase=name)`)."""
    if cp > 1:
        batch = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    with sequence_slices(accelerator, recipe, batch, cp):
        compute: Any = recipe.compute_loss  # an alternating recipe's takes its phase (Recipe.alternate_optimizers)
        for phase in phases:
            loss = compute(model, batch) if phase is None else compute(model, batch, phase=phase)
            accelerator.backward(read_loss_output(loss).loss)


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [[names[id(parameter)] for parameter in group["params"]] for group in optimizer.param_groups]


def _point_at(optimizer: torch.optim.Optimizer, model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Give the optimizer the prepared model's parameters by name. accelerate maps them by `data_ptr()`, which
    is 0 for every fake tensor: the optimizer would keep one of them (a real one keeps all, by the same names)."""
    prepared = dict(getattr(model, "module", model).named_parameters())
    for group, group_names in zip(optimizer.param_groups, groups, strict=True):
        group["params"] = [prepared[name.removeprefix("module.")] for name in group_names]


class _NoHook:
    """The handle of a hook never installed."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class _LocalTensorTracker(MemTracker):
    """torch's `MemTracker` for the totals alone. It counts the local tensors a DTensor op runs on rather than the
    DTensor op itself: tracking the DTensor op sent DTensor down its slow path, which fails on an unevenly
    sharded dimension (a vocabulary of 257 split over 2 tensor-parallel processes: a shape error on the
    second). Its per-module records refuse a module run twice in a step, as a pipeline's stage is (once per
    slice): those records are not kept."""

    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        """torch's, which hooks the gradient of every parameter, frozen ones too, where `register_hook` refuses
        them (a preference tune's frozen reference copy): a frozen parameter's hooks count as installed. Canary:
        tests/unit/estimate/test_step_memory.py."""
        for parameter in module.parameters():
            if not parameter.requires_grad and self._param_to_grad_hook_handles.get(parameter) is None:
                self._param_to_grad_hook_handles[parameter] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)  # type: ignore[no-any-return]

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        with contextlib.suppress(NotImplementedError):  # "multiple iterative calls": the stage's next slice
            super()._pre_fw_hook(module, inputs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented  # DTensor runs it on its local tensors, which this mode then sees
        return super().__torch_dispatch__(func, types, args, kwargs)


class Optimizers:
    """The prepared optimizers stepped together (a recipe with several steps each in a step)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def _by_kind(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    """Bytes per kind over every device of a tracker snapshot: param, grad, opt and the total."""
    kinds = {"param": _MemRefType.PARAM, "grad": _MemRefType.GRAD, "opt": _MemRefType.OPT}
    totals = dict.fromkeys([*kinds, "total"], 0)
    for per_kind in snapshot.values():
        for name, kind in kinds.items():
            totals[name] += per_kind.get(kind, 0)
        totals["total"] += per_kind.get("Total", 0)
    return totals
