"""The gradients of a pipeline: weights tied across stages, and one norm over every stage.

A weight tied across stages (an LM head and its embedding) is held by each stage that uses them, under that
stage's name; its gradients are summed between those processes before clipping and the step, which keeps the
copies identical. Under FSDP the copies are sharded alike, so their local shards are summed. The norm for
clipping is the square root of the sum, over all processes, of each process's local (shard of its) stages'
squared gradient norms, each tied weight counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel_trainer.parallel.pipeline.sharding import PipelinePlace
from accel_trainer.parallel.pipeline.split import tied_groups
from accel_trainer.parallel.sharding import local_part


@dataclass
class PipelineGradients:
    """This process's tied copies with the process group that sums them, and the names another process
    counts in the norm."""

    view: nn.Module
    tied: list[tuple[nn.Parameter, Any]] = field(default_factory=list)
    uncounted: set[str] = field(default_factory=set)

    @classmethod
    def of(
        cls, model: nn.Module, view: nn.Module, holders: dict[int, set[str]], place: PipelinePlace
    ) -> PipelineGradients:
        """Groups are created on every process, in the same order, as torch requires: for each tied group held
        on several stage ranks, one per data-parallel rank."""
        gradients = cls(view)
        for names in tied_groups(model):
            stage_ranks = sorted({i % place.stages for i, held in holders.items() if held & set(names)})
            if len(stage_ranks) < 2:
                continue
            mine = [name for name, _ in view.named_parameters() if name in names]
            for data_rank in range(place.data_ranks):
                group = dist.new_group([rank * place.data_ranks + data_rank for rank in stage_ranks])
                if data_rank == place.data_rank and mine:
                    gradients.tied.append((view.get_parameter(mine[0]), group))
                    if place.stage_rank != stage_ranks[0]:
                        gradients.uncounted.add(mine[0])
        return gradients

    def sum_tied(self) -> None:
        """Sum the gradients of weights tied across stages, so that every copy takes the same step."""
        for parameter, group in self.tied:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(local_part(parameter.grad), group=group)

    def clip(self, max_norm: float, device: torch.device) -> torch.Tensor:
        """Clip by the norm of all stages' gradients together; return that norm."""
        named = [(name, local_part(p.grad)) for name, p in self.view.named_parameters() if p.grad is not None]
        counted = [grad for name, grad in named if name not in self.uncounted]
        local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=device)
        squared = local.float().pow(2)
        dist.all_reduce(squared)
        total = squared.sqrt()
        if named:  # clip_grads_with_norm_'s formula, applied to the local shards (it refuses DTensor x Tensor)
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_([grad for _, grad in named], coefficient.to(named[0][1].dtype))
        return total
