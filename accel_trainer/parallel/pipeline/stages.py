"""Pipeline parallelism: the recipe's model cut into stages (parallel/pipeline/split.py), run by torch's schedules.

One loop still runs every layout: where the loop would call the recipe's `compute_loss` and back-propagate,
a pipeline layout calls `Pipeline.train`, which runs the schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)
over `pp_microbatches` slices of the micro-batch, forward and backward. Every process of the pipeline loads
the same micro-batch: the first stage feeds the model's inputs in, the last stage computes the loss.

The recipe's code runs unchanged. Its `compute_loss(model, batch)` is called twice with stand-ins for the
model: once with one that only records the arguments it is called with (the inputs the first stage needs),
and, on the last stage, once per pipeline slice with one that returns that stage's output, on the rows of the
batch in that slice (the schedule slices a row index, given as its "target"). A token loss's sums and counts
add up over the slices exactly; a mean loss is averaged over equal slices. The loss, item count and terms go
from the last stage to every process, so the loop logs and normalises as on any layout.

Tracing (torch.export) fixes shapes: a micro-batch of shapes not seen before is traced again (about half a
second for the GPT, cached), so variable-length batches work, except for training under FSDP
(parallel/pipeline/sharding.py). Weights tied across stages are summed between stages (parallel/pipeline/gradients.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from accel_trainer.contract.batch_rows import select_rows
from accel_trainer.contract.eval_outputs import metric_sums
from accel_trainer.contract.losses import LossOutput, read_loss_output
from accel_trainer.errors import ConfigError, RecipeError
from accel_trainer.parallel.pipeline.gradients import PipelineGradients
from accel_trainer.parallel.pipeline.recipe_calls import StageOutput, batch_size, model_inputs
from accel_trainer.parallel.pipeline.sharding import (
    adopt_parameters,
    checkpoint_blocks,
    gathered_weights,
    pipeline_place,
    shard_stage,
)
from accel_trainer.parallel.pipeline.split import (
    first_chunk,
    local_view,
    outermost_blocks,
    share_model_parameters,
    split_spec,
    stage_tensor_names,
    stages_of_process,
    traced_pipeline,
)
from accel_trainer.parallel.wrapping import block_classes

SCHEDULES: dict[str, tuple[Any, int]] = {  # name -> (torch schedule, stages per process)
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "looped_bfs": (ScheduleLoopedBFS, 2),
}


@dataclass
class _Compiled:
    """The stages and schedule traced for one set of input shapes."""

    modules: list[nn.Module]
    schedule: Any
    shapes: tuple[Any, ...] = ()


@dataclass
class _Step:
    """What the loss function of the current schedule call needs and collects."""

    batch: Any = None
    size: int = 0
    train: bool = True
    losses: list[LossOutput] = field(default_factory=list)
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # sums, weights


class Pipeline:
    """This process's stages of the recipe's model, and the schedule that trains and evaluates them."""

    def __init__(
        self,
        recipe: Any,
        model: nn.Module,
        sample_batch: Any,
        *,
        schedule: str,
        microbatches: int,
        accumulation_steps: int,
        device: torch.device,
        autocast: Any = contextlib.nullcontext,
        mesh: DeviceMesh | None = None,
        reshard_after_forward: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        self.recipe, self.model, self.device, self.autocast = recipe, model, device, autocast
        self.accumulation_steps = accumulation_steps
        self.place = pipeline_place(mesh)
        self.schedule_class, per_process = SCHEDULES[schedule]
        self.num_stages = self.place.stages * per_process
        self.chunks = microbatches or self.num_stages
        self.spec = split_spec(model, recipe, self.num_stages)
        self.blocks = outermost_blocks(model, block_classes(recipe, model))  # FSDP units, checkpointed blocks
        self.checkpointed = self.blocks if activation_checkpointing else []
        self.stage_ids = stages_of_process(self.place.stage_rank, self.place.stages, self.num_stages)
        self._compiled: dict[Any, _Compiled] = {}
        self._step = _Step()
        self._term_names: list[str] | None = None
        self._counts_items = False
        args, kwargs = model_inputs(recipe.compute_loss, sample_batch)
        rows_per_batch = batch_size(args, kwargs)
        if rows_per_batch % self.chunks:
            raise ConfigError(
                f"the pipeline slices each micro-batch into {self.chunks} (pp_microbatches; 0 means one slice per"
                f" stage), which does not divide micro_batch_size={rows_per_batch}: make micro_batch_size a multiple"
                " of it, or set pp_microbatches to a divisor"
            )
        pipe = self._trace(args, kwargs, self.chunks, train=True)
        holders = {i: stage_tensor_names(pipe.get_stage_module(i)) for i in range(self.num_stages)}
        self.view = local_view(model, set().union(*(holders[i] for i in self.stage_ids)))
        self._training: _Compiled | None = None  # under FSDP: the only training stages (one set of shapes)
        first = self._compiled_for(args, kwargs, train=True, traced=pipe)  # the first shapes' stages, not re-traced
        if self.place.shard_mesh is not None:
            self._training = first
            for module in first.modules:
                shard_stage(module, self.place.shard_mesh, self.blocks, reshard_after_forward)
            adopt_parameters(self.view, first.modules)
        self.gradients = PipelineGradients.of(model, self.view, holders, self.place)  # after FSDP: its parameters

    # -- tracing -------------------------------------------------------------------------------------------

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any], chunks: int, train: bool) -> Any:
        self.model.train(train)
        # Traced in the run's precision: the messages between stages are sized for the dtypes they carry
        # (traced in fp32, a bf16 run's stages misread each other's activations: NaN losses, measured).
        with self.autocast():
            return traced_pipeline(self.model, first_chunk(args, chunks), first_chunk(kwargs, chunks), self.spec)

    def _compiled_for(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool, traced: Any = None
    ) -> _Compiled:
        """The stages and schedule for these inputs' shapes, traced once per shape (`traced`: already)."""
        chunks = self.chunks if train else 1
        shapes = tuple((tuple(v.shape), v.dtype) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        key = (train, shapes)
        if key not in self._compiled and train and self._training is not None:
            raise ConfigError(
                f"pipeline x FSDP trains stages traced for one micro-batch shape, {_shapes(self._training)}, and"
                f" met {[list(shape) for shape, _ in shapes]}: make every training micro-batch the same shape"
                " (pad to one length in the recipe's collate; the gpt recipe: pad_to_block_size=true)"
            )
        if key not in self._compiled:
            pipe = traced if traced is not None else self._trace(args, kwargs, chunks, train)
            for i in self.stage_ids:
                share_model_parameters(pipe.get_stage_module(i), self.model)
            stages = [pipe.build_stage(i, self.device, group=self.place.group) for i in self.stage_ids]
            for stage in stages if train else []:  # before fully_shard, as accelerate orders them
                checkpoint_blocks(stage.submod, self.checkpointed)
            # Evaluation runs forward only, the whole micro-batch at once (any size).
            forward_only = ScheduleGPipe if len(stages) == 1 else ScheduleLoopedBFS
            schedule_class: Any = self.schedule_class if train else forward_only
            single = schedule_class in (ScheduleGPipe, Schedule1F1B)  # one stage per process
            schedule = schedule_class(stages[0] if single else stages, chunks, loss_fn=self._loss, scale_grads=False)
            self._compiled[key] = _Compiled([stage.submod for stage in stages], schedule, shapes)
        return self._compiled[key]

    # -- the loss on the last stage --------------------------------------------------------------------------

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        step = self._step
        batch = select_rows(step.batch, index, step.size)
        if not step.train:
            chunk = self.recipe.eval_metrics(StageOutput(output), batch)
            for name, (total, weight) in metric_sums(chunk, len(index), self.device).items():
                kept = step.metrics.get(name)
                step.metrics[name] = (total, weight) if kept is None else (kept[0] + total, kept[1] + weight)
            return torch.zeros((), device=self.device)
        result = read_loss_output(self.recipe.compute_loss(StageOutput(output), batch))
        step.losses.append(result)
        loss = result.loss if result.num_items is not None else result.loss / self.chunks
        return loss / self.accumulation_steps  # as accelerate's backward divides it

    # -- the loop's calls ------------------------------------------------------------------------------------

    def train(self, batch: Any) -> LossOutput:
        """Forward and backward of one micro-batch through the pipeline; its loss as `compute_loss` gives it
        on one process (a sum with its item count, or a mean), on every process."""
        args, kwargs = model_inputs(self.recipe.compute_loss, batch)
        compiled = self._compiled_for(args, kwargs, train=True)
        for module in compiled.modules:
            module.train()
        size = batch_size(args, kwargs)
        self._step = _Step(batch=batch, size=size, train=True)
        with self.autocast():
            compiled.schedule.step(*args, target=torch.arange(size), return_outputs=False, **kwargs)
        return self._shared_loss()

    def eval_metrics(self, model: nn.Module, batch: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The sums of the recipe's eval metrics over one batch and their weights (eval_outputs.metric_sums),
        computed on the last stage, on every process."""
        args, kwargs = model_inputs(self.recipe.eval_metrics, batch)
        compiled = self._compiled_for(args, kwargs, train=False)
        for module in compiled.modules:
            module.eval()
        size = batch_size(args, kwargs)
        self._step = _Step(batch=batch, size=size, train=False)
        with self._weights_for(compiled), self.autocast():
            compiled.schedule.eval(*args, target=torch.arange(size), **kwargs)
        shared = [{name: (total.cpu(), weight.cpu()) for name, (total, weight) in self._step.metrics.items()}]
        dist.broadcast_object_list(shared, src=self._last_process, group=self.place.group)
        return {name: (total.to(self.device), weight.to(self.device)) for name, (total, weight) in shared[0].items()}

    @contextlib.contextmanager
    def _weights_for(self, compiled: _Compiled) -> Any:
        """Under FSDP, evaluation stages run on the training stages' gathered weights; else nothing to do."""
        if self._training is None:
            yield
            return
        with gathered_weights(self._training.modules):
            for evaluating, training in zip(compiled.modules, self._training.modules, strict=True):
                share_model_parameters(evaluating, training)
            yield

    @property
    def _last_process(self) -> int:
        return self.place.process_of((self.num_stages - 1) % self.place.stages)

    def _shared_loss(self) -> LossOutput:
        """Combine the slices' losses on the last stage and give every process the result."""
        losses = self._step.losses
        if self._term_names is None:  # once: the recipe's terms, whether its loss counts items, whether a term does
            first = losses[0] if losses else None
            shape: list[Any] = [
                (sorted(first.terms), first.num_items is not None, bool(first.counts)) if first else None
            ]
            dist.broadcast_object_list(shape, src=self._last_process, group=self.place.group)
            self._term_names, self._counts_items, counted = shape[0]
            if counted:  # on every stage at once: none waits for a broadcast that never comes
                raise RecipeError(
                    "compute_loss returned a term with a count of its own: pipeline layouts do not log one"
                )
        terms = self._term_names
        packed = torch.zeros(2 + len(terms), device=self.device)
        if losses:
            combine = torch.sum if self._counts_items else torch.mean
            packed[0] = combine(torch.stack([r.loss.detach().float() for r in losses]))
            if self._counts_items:
                packed[1] = torch.stack([r.num_items.float() for r in losses]).sum()  # type: ignore[union-attr]
            for i, name in enumerate(terms):
                packed[2 + i] = combine(torch.stack([r.terms[name].float() for r in losses]))
        dist.broadcast(packed, src=self._last_process, group=self.place.group)
        num_items = packed[1] if self._counts_items else None
        return LossOutput(packed[0], num_items, {name: packed[2 + i] for i, name in enumerate(terms)})

    # -- weights tied across stages, and the global gradient norm (parallel/pipeline/gradients.py) ------------------

    def sum_tied_gradients(self) -> None:
        self.gradients.sum_tied()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.gradients.clip(max_norm, self.device)


def _shapes(compiled: _Compiled) -> list[list[int]]:
    return [list(shape) for shape, _ in compiled.shapes]
