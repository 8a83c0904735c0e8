"""Pipeline x FSDP: each stage's weights sharded over the data-parallel processes that run that stage.

On an FSDP layout with `pp_size` stages, the processes form a `(pp, dp_shard)` mesh, pp outermost: the
processes of one `dp_shard` index form one pipeline (they pass activations along it), and the processes of
one stage form one FSDP group (they hold a shard each of that stage's weights). FSDP2's `fully_shard` wraps
each traced stage module, its blocks first; torch's schedules know FSDP modules and reduce-scatter the
gradients once per schedule step. `reshard_after_forward` follows the layout's `fsdp_reshard_after_forward`
(false keeps a stage's weights gathered across the slices of a micro-batch: torch's advice under a pipeline).

Why training shapes are fixed under FSDP: a traced stage is specialised to its input shapes, and
`fully_shard` makes the stage module own its (sharded) parameters, which a stage traced again for new shapes
cannot share. So every training micro-batch must have the shapes of the first, or the run stops with a
one-line error. Evaluation, which needs no gradient, traces stages for its own shapes and runs them on the
gathered weights of the training stages (`gathered_weights`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class PipelinePlace:
    """Where this process sits: its stage rank in its pipeline and its data-parallel rank (FSDP shard)."""

    stage_rank: int
    stages: int  # processes per pipeline (pp_size)
    data_rank: int
    data_ranks: int  # processes per stage (dp_shard size; 1 without FSDP)
    group: Any = None  # the process group of this process's pipeline; None: the world
    shard_mesh: DeviceMesh | None = None  # the FSDP mesh of this process's stage

    def process_of(self, stage_rank: int) -> int:
        """The global rank of the process at `stage_rank` in this process's pipeline."""
        return stage_rank * self.data_ranks + self.data_rank


def pipeline_place(mesh: DeviceMesh | None) -> PipelinePlace:
    """This process's place, from the run's `(pp, dp_shard)` mesh, or the world when there is none."""
    if mesh is None:
        return PipelinePlace(dist.get_rank(), dist.get_world_size(), 0, 1)
    pipeline, shard = mesh["pp"], mesh["dp_shard"]
    return PipelinePlace(
        pipeline.get_local_rank(), pipeline.size(), shard.get_local_rank(), shard.size(), pipeline.get_group(), shard
    )


def shard_stage(module: nn.Module, mesh: DeviceMesh, block_names: list[str], reshard_after_forward: bool) -> None:
    """FSDP2 over `mesh`: each of the stage's blocks (by their names in the model), then the stage itself."""
    for name, block in module.named_modules():
        if name in block_names:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)


@contextlib.contextmanager
def gathered_weights(modules: list[nn.Module]) -> Iterator[None]:
    """The FSDP stages' full weights registered on their modules (a collective), sharded again after."""
    sharded = [module for root in modules for module in root.modules() if isinstance(module, FSDPModule)]
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()


def checkpoint_blocks(module: nn.Module, block_names: list[str]) -> None:
    """Recompute each block's activations in backward (activation_checkpointing on a pipeline): the block's
    forward runs under torch's non-reentrant checkpoint. Its `forward` is replaced on the instance rather than
    the block wrapped in a new module, so the stage keeps the model's parameter names; before `fully_shard`."""
    for name, block in module.named_modules():
        if name in block_names:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def adopt_parameters(view: nn.Module, stage_modules: list[nn.Module]) -> None:
    """Register the stages' (sharded) parameters in the local view under the same names, so the optimizer
    and checkpoints see what FSDP trains."""
    for stage in stage_modules:
        for name, parameter in stage.named_parameters(remove_duplicate=False):
            owner, _, attribute = name.rpartition(".")
            view.get_submodule(owner)._parameters[attribute] = parameter
