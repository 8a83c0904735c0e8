"""One optimizer step of the loop, owned by the `Stepper`: the micro-batches' forward and backward under
`accumulate`, the exact item normalisation, then clip, step, schedule and zero grad; once, or once per phase of a
recipe with several optimizers stepped in alternation (optim/optimizers.py). The non-finite guard's verdict of a
step is read at the next step wherever the optimizers can skip a step on the device (stopping/nonfinite.py).

An alternating step fetches its micro-batches once and runs them through every phase in order; before each
phase every gradient is dropped, so one phase's gradients never reach another's step. The step's loss
outputs come back merged for logging: `<phase>/loss` and `<phase>/<term>` for each phase, `loss` their sum.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator

from accel_trainer.checkpoint.generations import Generations
from accel_trainer.checkpoint.train_state import TrainState
from accel_trainer.contract.losses import LossOutput, read_loss_output
from accel_trainer.data.batching import BatchPlan
from accel_trainer.engine.hf_loss import ModelItems
from accel_trainer.engine.model_calls import ModelCalls
from accel_trainer.engine.rollouts import step_share
from accel_trainer.errors import RecipeError
from accel_trainer.observe.breadcrumb import note_where
from accel_trainer.observe.observer import Observer
from accel_trainer.optim.device_skip import DeviceSkip
from accel_trainer.optim.ema import WeightAverage
from accel_trainer.optim.optimizers import Optimizers, Phase
from accel_trainer.parallel.context_parallel import SequenceSlicing
from accel_trainer.parallel.mesh import DataRanks
from accel_trainer.parallel.pipeline.stages import Pipeline
from accel_trainer.parallel.sharding import local_part
from accel_trainer.parallel.verbs import discard_step, step_optimizers
from accel_trainer.stopping.nonfinite import NonfiniteGuard


class Stepper:
    """Trains one optimizer step at a time: built once by preparation with what a step needs, and nothing else."""

    def __init__(
        self,
        *,
        accelerator: Accelerator,
        compute_loss: Callable[..., Any],
        slicing: SequenceSlicing,
        model: Any,
        optimizers: Optimizers,
        plan: BatchPlan,
        ranks: DataRanks,
        progress: TrainState,
        global_batch_size: int,
        max_grad_norm: float,
        before_update: Callable[[], None],
        pipeline: Pipeline | None = None,
        guard: NonfiniteGuard | None = None,
        ema: WeightAverage | None = None,
        model_items: ModelItems | None = None,
        model_calls: ModelCalls | None = None,
        rollout: Callable[[Any, list[Any], int], list[Any]] | None = None,
        generations: Generations | None = None,
    ) -> None:
        self.accelerator, self.model, self.optimizers = accelerator, model, optimizers
        self.compute_loss, self.slicing = compute_loss, slicing  # the recipe's loss; its sequences under cp
        self.plan, self.ranks, self.progress, self.global_batch_size = plan, ranks, progress, global_batch_size
        self.max_grad_norm = max_grad_norm
        self.before_update = before_update  # the checkpointer's: a background save's copy must be done first
        self.pipeline, self.guard, self.ema = pipeline, guard, ema
        self.model_items = model_items  # passes a transformers model the step's item count (hf_loss.py)
        self.model_calls = model_calls  # whether compute_loss called the model itself (model_calls.py)
        self.rollout, self.generations = rollout, generations  # the recipe's, run before the forwards it feeds
        late = guard is not None and pipeline is None and not optimizers.alternate  # the guard may read a step late
        self.device_skip = DeviceSkip.of([p.verbs for p in optimizers.phases], accelerator.device) if late else None

    def counted(self) -> bool:
        """Whether the step just trained counts in the logged mean now: not a step the guard skipped, nor one whose
        verdict is still pending (its loss joins the mean when the verdict is read, if it is finite)."""
        return self.guard is None or (self.guard.pending is None and not self.guard.counts.nonfinite_in_a_row)

    def step(
        self, batches: Any, observer: Observer, step: int, is_log_step: bool
    ) -> tuple[list[LossOutput], dict[str, Any]]:
        """Train step `step` (the progress is set once its data is read); returns the loss outputs to log and the
        step's figures by log key: the gradient norm(s) when measured, and on log steps the LRs (lr, lr/1, ...;
        for several optimizers lr/<name>, lr/<name>/1, ..., and grad_norm/<name> for alternating phases)."""
        optimizers = self.optimizers
        if self.rollout is not None and self.generations is not None:  # built together
            fetch = functools.partial(self._fetch, batches, observer, step)  # at a generation's first step
            batches = step_share(self.rollout, self.generations, self.accelerator, self.model, fetch, step)
        if not optimizers.alternate:
            epoch, outputs = self._accumulate_gradients(batches, observer, None)
            self._advance(step, epoch)
            figures, stepped, _ = self._optimizer_step(optimizers.phases, is_log_step, outputs, observer)
            if stepped and self.ema is not None:
                self.ema.update()
            return outputs, figures
        fetched = self._fetch(batches, observer, step)
        per_phase, figures, norms, stepped, finite = [], {}, [], False, True
        for index, phase in enumerate(optimizers.phases):
            self.model.zero_grad(set_to_none=True)  # nothing of the previous phase reaches this one's step
            epoch, outputs = self._accumulate_gradients(iter(fetched), observer, phase.name)
            if index == 0:
                self._advance(step, epoch)
            phase_figures, phase_stepped, phase_finite = self._optimizer_step((phase,), is_log_step, outputs, observer)
            finite = finite and phase_finite
            figures.update(phase_figures)
            norms.append(phase_figures.get(f"grad_norm/{phase.name}"))
            per_phase.append((phase.name, outputs))
            stepped = stepped or phase_stepped
        self.model.zero_grad(set_to_none=True)  # the last phase's gradients of the other optimizers' parameters
        if self.guard is not None:  # the whole step counts once: non-finite if any phase was
            self.guard.count(finite)
        if stepped and self.ema is not None:
            self.ema.update()
        if all(norm is not None for norm in norms):
            figures["grad_norm"] = math.sqrt(sum(float(norm) ** 2 for norm in norms if norm is not None))
        return _merged(per_phase), figures

    def _accumulate_gradients(
        self, batches: Any, observer: Observer, phase: str | None
    ) -> tuple[int, list[LossOutput]]:
        """Run the micro-batches of one optimizer step (of one phase); gradients are synchronised on the last one.

        A loss returned with `num_items` is back-propagated as a sum and its gradients are divided by the item
        count of the whole step over all micro-batches and processes, which makes a token loss exact on any
        layout (the gradient-accumulation bug class of transformers #34191). Returns the epoch and the step's
        loss outputs, which the observer logs once the step is known to be finite.
        """
        accelerator, model, plan = self.accelerator, self.model, self.plan
        step_items: torch.Tensor | None = None
        step = self.progress.step + (1 if phase is None or phase == self.optimizers.phases[0].name else 0)
        outputs, waited = [], time.perf_counter()
        note_where("the data of step", step)  # where a hung or killed process says it was
        if self.model_items is not None:  # a transformers model's own loss: count the step's items first
            batches = self.model_items.fetch_step(batches, plan.accumulation_steps, accelerator, self.ranks.replicas)
        observer.waited_for_data(time.perf_counter() - waited)
        for index in range(plan.accumulation_steps):
            note_where("the data of step", step)
            waited = time.perf_counter()
            epoch, batch = next(batches)
            observer.waited_for_data(time.perf_counter() - waited)
            observer.saw_batch(batch)  # its shapes count the FLOPs
            # With one micro-batch per step there is nothing to accumulate and no synchronisation to skip; a
            # pipeline's schedule skips it itself (torch's schedules know FSDP stages).
            accumulates = plan.accumulation_steps > 1 and self.pipeline is None
            context = accelerator.accumulate(model) if accumulates else contextlib.nullcontext()
            with context, self.slicing.around(accelerator, batch):  # cp > 1: this process sees slices
                output = self._forward_backward(batch, step, index, phase)
            outputs.append(output)
            if output.num_items is not None:
                num_items = output.num_items.to(accelerator.device, torch.float32)
                step_items = num_items if step_items is None else step_items + num_items
        if self.pipeline is not None:
            self.pipeline.sum_tied_gradients()
        if step_items is not None:
            self._divide_by_items(step_items)
        return epoch, outputs

    def _divide_by_items(self, step_items: torch.Tensor) -> None:
        """accelerate scaled each sum by 1/accumulation_steps and the gradient all-reduce averaged over processes
        (over dp x cp: context-parallel processes hold slices); undo both and divide by the true item count of
        the step instead."""
        plan, ranks = self.plan, self.ranks
        total_items = self.accelerator.reduce(step_items, reduction="sum") / ranks.replicas  # TP, PP: copies
        scale = plan.accumulation_steps * plan.num_processes * ranks.context_parallel / total_items
        for parameter in self.model.parameters():
            if parameter.grad is not None:
                local = local_part(parameter.grad)
                local.mul_(scale.to(local.dtype))  # an FSDP2 shard is scaled in place like a whole gradient

    def _optimizer_step(
        self, phases: tuple[Phase, ...], is_log_step: bool, outputs: list[LossOutput], observer: Observer
    ) -> tuple[dict[str, Any], bool, bool]:
        """Clip, step the `phases`' optimizers and schedules, zero the gradients; the gradient norm and (on log
        steps) the LRs of this step by log key, whether an optimizer stepped (False for a step left pending,
        whose EMA update is done), and whether the non-finite guard let it (a step it rejects does nothing but
        drop the gradients)."""
        note_where("the gradient norm and optimizer step of step", self.progress.step)
        if self.guard is not None:  # the previous step's verdict, read while this step's work runs on the device
            self.guard.settle()  # before this step's LRs: the schedule steps for a finite step first
        grad_norm, verbs, name = None, phases[0].verbs, phases[0].name
        assert verbs is not None  # prepared phases hold their verbs
        if self.max_grad_norm > 0 or is_log_step or self.guard is not None:
            max_norm = self.max_grad_norm or float("inf")
            if self.pipeline is not None:  # one norm over all stages
                grad_norm = self.pipeline.clip_grad_norm(max_norm)
            else:  # over every gradient there is: an alternating phase's alone
                grad_norm = verbs.clip_grad_norm(max_norm)
        figures: dict[str, Any] = {}
        if grad_norm is not None:
            figures[f"grad_norm/{name}" if self.optimizers.alternate else "grad_norm"] = grad_norm
        if is_log_step:  # the LRs of this step, before the schedule moves them
            figures.update((key, lr) for phase in phases for key, lr in phase.lrs().items())
        every_verbs = [phase.verbs for phase in phases if phase.verbs is not None]
        if self._may_step_late(is_log_step):
            self._step_late(phases, outputs, grad_norm, observer)
            return figures, False, True
        count = not self.optimizers.alternate
        if self.guard is not None and not self.guard.step_is_finite(outputs, grad_norm, count=count):
            discard_step(every_verbs)  # counted by the guard
            return figures, False, False
        stepped = False
        self.before_update()
        taken = step_optimizers(every_verbs)
        for phase, phase_taken in zip(phases, taken, strict=True):
            assert phase.verbs is not None
            if phase_taken:
                phase.scheduler.step()  # the schedule follows the optimizer steps actually taken
                stepped = True
            else:  # fp16: the gradient scaler found inf/NaN gradients
                self.progress.skipped_steps += 1
            phase.verbs.zero_grad()
        return figures, stepped, True

    def _may_step_late(self, is_log_step: bool) -> bool:
        """Whether this step may be taken before its verdict is read (stopping/nonfinite.py says when not)."""
        skip, guard = self.device_skip, self.guard
        return skip is not None and guard is not None and not is_log_step and guard.may_wait() and skip.ready()

    def _step_late(
        self, phases: tuple[Phase, ...], outputs: list[LossOutput], grad_norm: Any, observer: Observer
    ) -> None:
        """Take the step with its verdict left on the device: the optimizers skip it there if it is not finite,
        the BatchNorm statistics and the EMA follow it there, and the guard reads it at the next step."""
        assert self.guard is not None and self.device_skip is not None
        every_verbs = [phase.verbs for phase in phases if phase.verbs is not None]
        finite = self.guard.verdict(outputs, grad_norm)
        self.guard.wait_for(finite, functools.partial(self._taken_late, phases, outputs, observer))
        self.before_update()
        with self.device_skip.unless(finite):
            step_optimizers(every_verbs)
        for verbs in every_verbs:
            verbs.zero_grad()
        if self.ema is not None:  # after the statistics are put back: a weight of 0 keeps the average as it was
            self.ema.update(taken=finite)

    def _taken_late(self, phases: tuple[Phase, ...], outputs: list[LossOutput], observer: Observer) -> None:
        """What the host does for a taken step, once its verdict is read: the schedule steps, its loss joins the
        logged mean (before the next step's: the same sums in the same order)."""
        for phase in phases:
            phase.scheduler.step()
        observer.window.add_step(outputs, self.plan.micro_batch_size)

    def _forward_backward(self, batch: Any, step: int, index: int, phase: str | None) -> Any:
        """Micro-batch `index`'s loss and gradients (a pipeline's schedule runs both, divided like backward's)."""
        if self.pipeline is not None:
            note_where("the pipeline's forward and backward of step", step)
            return self.pipeline.train(batch)
        note_where("the forward of step", step)
        if self.model_items is not None:  # the model may be given the step's item count
            self.model_items.forward_of(index)
        extra = {"phase": phase} if self.optimizers.alternate else {}
        calls = self.model_calls.count if self.model_calls is not None else 0
        output = read_loss_output(self.compute_loss(self.model, batch, **extra))
        if self.model_calls is not None:
            self.model_calls.check_called_since(calls, phase)
        if self.model_items is not None:
            output = self.model_items.exact(output)
        if phase is not None and self.optimizers.alternate and output.num_items is not None:
            raise RecipeError(
                f"compute_loss(phase={phase!r}) returned num_items: an alternating phase's loss is a batch mean for now"
            )
        self.slicing.check_loss(output.num_items)
        note_where("the backward (and gradient reduction) of step", step)
        verbs = self.optimizers.phases[0].verbs
        assert verbs is not None
        verbs.backward(output.loss)  # divided by the accumulation steps
        return output

    def _fetch(self, batches: Any, observer: Observer, step: int, count: int = 0) -> list[tuple[int, Any]]:
        """The step's micro-batches (or `count`), read once for every phase."""
        note_where("the data of step", step)
        waited = time.perf_counter()
        fetched = [next(batches) for _ in range(count or self.plan.accumulation_steps)]
        observer.waited_for_data(time.perf_counter() - waited)
        return fetched

    def _advance(self, step: int, epoch: int) -> None:
        progress, read = self.progress, self.generations.data_steps(step) if self.generations else step
        progress.epoch, progress.step, progress.samples_seen = epoch + 1, step, read * self.global_batch_size


def _merged(per_phase: list[tuple[str | None, list[LossOutput]]]) -> list[LossOutput]:
    """Each micro-batch's phase losses as one output: `loss` their sum, `<phase>/loss` and `<phase>/<term>`."""
    merged = []
    for outputs in zip(*(outputs for _, outputs in per_phase), strict=True):
        terms: dict[str, torch.Tensor] = {}
        counts: dict[str, torch.Tensor] = {}
        for (name, _), output in zip(per_phase, outputs, strict=True):
            terms[f"{name}/loss"] = output.loss.detach()
            terms.update({f"{name}/{term}": value for term, value in output.terms.items()})
            counts.update({f"{name}/{term}": count for term, count in output.counts.items()})
        merged.append(LossOutput(torch.stack([o.loss.detach() for o in outputs]).sum(), None, terms, counts))
    return merged
