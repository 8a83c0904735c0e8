"""One optimizer step of the loop: the micro-batches' forward and backward under `accumulate`, the exact item
normalisation, then clip, step, schedule and zero grad; once, or once per phase of a recipe with several
optimizers stepped in alternation (optimizers.py).

An alternating step fetches its micro-batches once and runs them through every phase in order; before each
phase every gradient is dropped, so one phase's gradients never reach another's step. The step's loss
outputs come back merged for logging: `<phase>/loss` and `<phase>/<term>` for each phase, `loss` their sum.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from accel_trainer.contract.losses import LossOutput, read_loss_output
from accel_trainer.errors import RecipeError
from accel_trainer.observe.breadcrumb import note_where
from accel_trainer.observe.observer import Observer
from accel_trainer.optim.optimizers import Phase
from accel_trainer.parallel.context_parallel import check_loss_counts_items, sequence_slices
from accel_trainer.parallel.sharding import local_part
from accel_trainer.parallel.verbs import discard_step, step_optimizers

if TYPE_CHECKING:
    from accel_trainer.engine.preparation import Run


def train_step(
    run: Run, batches: Any, observer: Observer, step: int, is_log_step: bool
) -> tuple[list[LossOutput], dict[str, Any]]:
    """Train step `step` (its state is set once its data is read); returns the loss outputs to log and the
    step's figures by log key: the gradient norm(s) when measured, and on log steps the LRs (lr, lr/1, ...;
    for several optimizers lr/<name>, lr/<name>/1, ..., and grad_norm/<name> for alternating phases)."""
    optimizers = run.optimizers
    if not optimizers.alternate:
        epoch, outputs = accumulate_gradients(run, batches, observer, None)
        _advance(run, step, epoch)
        figures, stepped, _ = optimizer_step(run, optimizers.phases, is_log_step, outputs)
        if stepped and run.ema is not None:
            run.ema.update()
        return outputs, figures
    fetched = _fetch(run, batches, observer, step)
    per_phase, figures, norms, stepped, finite = [], {}, [], False, True
    for index, phase in enumerate(optimizers.phases):
        run.model.zero_grad(set_to_none=True)  # nothing of the previous phase reaches this one's step
        epoch, outputs = accumulate_gradients(run, iter(fetched), observer, phase.name)
        if index == 0:
            _advance(run, step, epoch)
        phase_figures, phase_stepped, phase_finite = optimizer_step(run, (phase,), is_log_step, outputs)
        finite = finite and phase_finite
        figures.update(phase_figures)
        norms.append(phase_figures.get(f"grad_norm/{phase.name}"))
        per_phase.append((phase.name, outputs))
        stepped = stepped or phase_stepped
    run.model.zero_grad(set_to_none=True)  # the last phase's gradients of the other optimizers' parameters
    if run.guard is not None:  # the whole step counts once: non-finite if any phase was
        run.guard.count(run.checkpointer.state, finite)
    if stepped and run.ema is not None:
        run.ema.update()
    if all(norm is not None for norm in norms):
        figures["grad_norm"] = math.sqrt(sum(float(norm) ** 2 for norm in norms if norm is not None))
    return _merged(per_phase), figures


def accumulate_gradients(run: Run, batches: Any, observer: Observer, phase: str | None) -> tuple[int, list[LossOutput]]:
    """Run the micro-batches of one optimizer step (of one phase); gradients are synchronised on the last one.

    A loss returned with `num_items` is back-propagated as a sum and its gradients are divided by the item
    count of the whole step over all micro-batches and processes, which makes a token loss exact on any
    layout (the gradient-accumulation bug class of transformers #34191). Returns the epoch and the step's loss
    outputs, which the observer logs once the step is known to be finite.
    """
    accelerator, model, plan = run.accelerator, run.model, run.plan
    step_items: torch.Tensor | None = None
    step = run.checkpointer.state.step + (1 if phase is None or phase == run.optimizers.phases[0].name else 0)
    outputs, waited = [], time.perf_counter()
    note_where("the data of step", step)  # where a hung or killed process says it was
    if run.model_items is not None:  # a transformers model's own loss: count the step's items first (hf_loss.py)
        batches = run.model_items.fetch_step(batches, plan.accumulation_steps, accelerator, run.ranks.replicas)
    observer.waited_for_data(time.perf_counter() - waited)
    for index in range(plan.accumulation_steps):
        note_where("the data of step", step)
        waited = time.perf_counter()
        epoch, batch = next(batches)
        observer.waited_for_data(time.perf_counter() - waited)
        observer.saw_batch(batch)  # its shapes count the FLOPs
        # With one micro-batch per step there is nothing to accumulate and no synchronisation to skip; a
        # pipeline's schedule skips it itself (torch's schedules know FSDP stages).
        accumulates = plan.accumulation_steps > 1 and run.pipeline is None
        context = accelerator.accumulate(model) if accumulates else contextlib.nullcontext()
        cp = run.ranks.context_parallel  # > 1: this process sees a slice of each sequence (context_parallel.py)
        with context, sequence_slices(accelerator, run.recipe, batch, cp):
            output = _forward_backward(run, batch, step, cp, index, phase)
        outputs.append(output)
        if output.num_items is not None:
            num_items = output.num_items.to(accelerator.device, torch.float32)
            step_items = num_items if step_items is None else step_items + num_items
    if run.pipeline is not None:
        run.pipeline.sum_tied_gradients()
    if step_items is not None:
        # accelerate scaled each sum by 1/accumulation_steps and the gradient all-reduce averaged over
        # processes (over dp x cp: context-parallel processes hold slices); undo both and divide by the true
        # item count of the step instead.
        total_items = accelerator.reduce(step_items, reduction="sum") / run.ranks.replicas  # TP, PP: copies
        scale = plan.accumulation_steps * plan.num_processes * run.ranks.context_parallel / total_items
        for parameter in model.parameters():
            if parameter.grad is not None:
                local = local_part(parameter.grad)
                local.mul_(scale.to(local.dtype))  # an FSDP2 shard is scaled in place like a whole gradient
    return epoch, outputs


def optimizer_step(
    run: Run, phases: tuple[Phase, ...], is_log_step: bool, outputs: list[LossOutput]
) -> tuple[dict[str, Any], bool, bool]:
    """Clip, step the `phases`' optimizers and schedules, zero the gradients; the gradient norm and (on log
    steps) the LRs of this step by log key, whether an optimizer stepped, and whether the non-finite guard let
    it (a step it rejects does nothing but drop the gradients)."""
    cfg, state = run.cfg, run.checkpointer.state
    note_where("the gradient norm and optimizer step of step", state.step)
    grad_norm, verbs, name = None, phases[0].verbs, phases[0].name
    assert verbs is not None  # prepared phases hold their verbs
    if cfg.max_grad_norm > 0 or is_log_step or run.guard is not None:
        max_norm = cfg.max_grad_norm or float("inf")
        if run.pipeline is not None:  # one norm over all stages
            grad_norm = run.pipeline.clip_grad_norm(max_norm)
        else:  # over every gradient there is: an alternating phase's alone
            grad_norm = verbs.clip_grad_norm(max_norm)
    figures: dict[str, Any] = {}
    if grad_norm is not None:
        figures[f"grad_norm/{name}" if run.optimizers.alternate else "grad_norm"] = grad_norm
    if is_log_step:  # the LRs of this step, before the schedule moves them
        figures.update((key, lr) for phase in phases for key, lr in phase.lrs().items())
    if run.guard is not None and not run.guard.step_is_finite(
        state, outputs, grad_norm, count=not run.optimizers.alternate
    ):
        discard_step([phase.verbs for phase in phases if phase.verbs is not None])  # counted in state
        return figures, False, False
    stepped = False
    run.checkpointer.before_update()
    taken = step_optimizers([phase.verbs for phase in phases if phase.verbs is not None])
    for phase, phase_taken in zip(phases, taken, strict=True):
        assert phase.verbs is not None
        if phase_taken:
            phase.scheduler.step()  # the schedule follows the optimizer steps actually taken
            stepped = True
        else:  # fp16: the gradient scaler found inf/NaN gradients
            state.skipped_steps += 1
        phase.verbs.zero_grad()
    return figures, stepped, True


def _forward_backward(run: Run, batch: Any, step: int, cp: int, index: int, phase: str | None) -> Any:
    """Micro-batch `index`'s loss and gradients (a pipeline's schedule runs both, divided like backward's)."""
    if run.pipeline is not None:
        note_where("the pipeline's forward and backward of step", step)
        return run.pipeline.train(batch)
    note_where("the forward of step", step)
    if run.model_items is not None:  # the model may be given the step's item count
        run.model_items.forward_of(index)
    extra = {"phase": phase} if run.optimizers.alternate else {}
    calls = run.model_calls.count if run.model_calls is not None else 0
    output = read_loss_output(run.recipe.compute_loss(run.model, batch, **extra))
    if run.model_calls is not None:
        run.model_calls.check_called_since(calls, phase)
    if run.model_items is not None:
        output = run.model_items.exact(output)
    if phase is not None and run.optimizers.alternate and output.num_items is not None:
        raise RecipeError(
            f"compute_loss(phase={phase!r}) returned num_items: an alternating phase's loss is a batch mean for now"
        )
    check_loss_counts_items(output.num_items, run.recipe, cp)
    note_where("the backward (and gradient reduction) of step", step)
    verbs = run.optimizers.phases[0].verbs
    assert verbs is not None
    verbs.backward(output.loss)  # divided by the accumulation steps
    return output


def _fetch(run: Run, batches: Any, observer: Observer, step: int) -> list[tuple[int, Any]]:
    """The step's micro-batches, read once for every phase."""
    note_where("the data of step", step)
    waited = time.perf_counter()
    fetched = [next(batches) for _ in range(run.plan.accumulation_steps)]
    observer.waited_for_data(time.perf_counter() - waited)
    return fetched


def _advance(run: Run, step: int, epoch: int) -> None:
    state = run.checkpointer.state
    state.epoch, state.step, state.samples_seen = epoch + 1, step, step * run.cfg.global_batch_size


def _merged(per_phase: list[tuple[str | None, list[LossOutput]]]) -> list[LossOutput]:
    """Each micro-batch's phase losses as one output: `loss` their sum, `<phase>/loss` and `<phase>/<term>`."""
    merged = []
    for outputs in zip(*(outputs for _, outputs in per_phase), strict=True):
        terms: dict[str, torch.Tensor] = {}
        for (name, _), output in zip(per_phase, outputs, strict=True):
            terms[f"{name}/loss"] = output.loss.detach()
            terms.update({f"{name}/{term}": value for term, value in output.terms.items()})
        merged.append(LossOutput(torch.stack([o.loss.detach() for o in outputs]).sum(), None, terms))
    return merged
