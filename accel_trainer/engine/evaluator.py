"""Evaluation: the means of a recipe's per-sample eval metrics over the whole eval set, on any layout."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, send_to_device

from accel_trainer.config.train_config import TrainConfig, evaluates_after
from accel_trainer.contract.batch_rows import batch_size, first_rows
from accel_trainer.contract.eval_outputs import metric_sums
from accel_trainer.data.rng import rng_untouched
from accel_trainer.errors import RecipeError, UserError, recipe_site
from accel_trainer.observe.breadcrumb import note_where
from accel_trainer.observe.observer import Observer
from accel_trainer.parallel.batchnorm import average_running_stats
from accel_trainer.parallel.pipeline.stages import Pipeline
from accel_trainer.recipe import Recipe

if TYPE_CHECKING:
    from accel_trainer.engine.preparation import Run


def describe_nonfinite(cfg: TrainConfig, scores: dict[str, float], step: int) -> str:
    """One line naming the eval metrics that are NaN or infinite, and what keep-best and early stopping make of
    them (never a new best, never an improvement); "" when all are finite."""
    bad = [name for name, value in scores.items() if not math.isfinite(value)]
    if not bad:
        return ""
    line = f"accel-trainer: {', '.join(f'{name}={scores[name]}' for name in bad)} after step {step}: not finite"
    uses = [
        what
        for what, name in (("keep-best", cfg.keep_best_metric), ("early stopping", cfg.early_stop_metric))
        if name in bad
    ]
    return line + (f"; {' and '.join(uses)} count it as no improvement" if uses else "")


def evaluate(
    accelerator: Accelerator, recipe: Recipe | Pipeline, model: torch.nn.Module, batches: Any, padded: bool
) -> dict[str, float]:
    """The recipe's eval metrics over the whole eval set, each sample counted once (on a pipeline layout,
    `recipe` is the pipeline, which runs the recipe's eval_metrics on its last stage).

    Each metric is a mean over the samples, or over its items for a (sums, num_items) pair (eval_outputs.py).
    The recipe sees only real rows: a `padded` loader's last batch, which accelerate evens out across the
    processes with duplicates of the first samples, is cut to the rows `gather_for_metrics` would keep before
    `eval_metrics` runs, so a batch mean (the default eval of a mean `compute_loss`) is exact too. A process
    whose last batch holds no real row still runs it (FSDP's forward is collective) and counts nothing. Each
    process sums its batches; the sums are combined on the host (eval is rare), so processes may see unequal
    numbers of batches (a stream's disjoint shares, streams.eval_batches).
    """
    average_running_stats(accelerator, model)
    model.eval()
    sums: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for batch in batches:
            size = batch_size(batch)
            rows = _rows_counted(accelerator, size) if padded else size
            output = recipe.eval_metrics(model, first_rows(batch, rows) if 0 < rows < size else batch)
            if rows == 0:
                continue
            for name, (total, weight) in metric_sums(output, rows, accelerator.device).items():
                if name in sums:
                    sums[name][0] += total
                    sums[name][1] += weight
                else:
                    sums[name] = [total, weight]
    model.train()
    totals: dict[str, list[float]] = {}
    for part in gather_object([{name: [float(total), float(weight)] for name, (total, weight) in sums.items()}]):
        for name, (total, weight) in part.items():
            kept = totals.setdefault(name, [0.0, 0.0])
            kept[0], kept[1] = kept[0] + total, kept[1] + weight
    return {f"eval/{name}": _ratio(total, weight) for name, (total, weight) in totals.items()}


def _rows_counted(accelerator: Accelerator, size: int) -> int:
    """How many leading rows of this process's current batch are real samples: all but in the last batch of a
    loader that accelerate evened out, where `gather_for_metrics` itself says which rows it keeps."""
    if not accelerator.gradient_state.end_of_dataloader:
        return size
    tags = torch.arange(size, device=accelerator.device) + accelerator.process_index * size
    kept = accelerator.gather_for_metrics(tags)
    return int((kept // size == accelerator.process_index).sum())


def _ratio(total: float, weight: float) -> float:
    return total / weight if weight else float("nan")


def evaluate_run(run: Run) -> dict[str, float]:
    """The run's eval metrics (`eval/<name>`) and, with evaluate_ema, its EMA weights' (`eval_ema/<name>`); the
    random streams are left as they were, so training does not depend on when it evaluates."""
    with rng_untouched():
        scores = evaluate(run.accelerator, run.evaluator, run.model, *run.data.eval_batches())
        if run.cfg.evaluate_ema and run.ema is not None:
            with run.ema.swapped_in():
                averaged = evaluate(run.accelerator, run.evaluator, run.model, *run.data.eval_batches())
            scores.update({"eval_ema/" + name.removeprefix("eval/"): value for name, value in averaged.items()})
    return scores


def sanity_check(run: Run) -> None:
    """The recipe's eval metrics on the eval set's first micro-batch, before the first step (`sanity_eval`): an eval
    set with no example, a collate or a metric that fails, or a metric the loop cannot read is a one-line error now,
    not after the training. Every process runs the same batch (a sharded forward is collective); the random streams
    and the model's mode are left as they were, so the training does not change.

    Raises:
        RecipeError: naming what failed (the exception and where, for a recipe's bug).
    """
    if not run.cfg.sanity_eval or run.data.eval_set is None:
        return
    note_where("the sanity check of eval_metrics before step", run.checkpointer.state.step + 1)
    examples = run.data.first_eval_examples()
    if not examples:
        raise RecipeError("the eval set holds no example: give it some (or build_datasets may return None as eval)")
    with _said_in_one_line("collate fails on the first eval examples"):
        batch = send_to_device(run.data.collate(examples), run.accelerator.device)
    with _said_in_one_line("eval_metrics fails on the first eval batch"), rng_untouched():
        evaluate(run.accelerator, run.evaluator, run.model, [batch], padded=False)


@contextlib.contextmanager
def _said_in_one_line(what: str) -> Iterator[None]:
    """A recipe's exception inside, as a RecipeError of one line: `what`, the exception and where it was raised."""
    try:
        yield
    except UserError as error:
        raise RecipeError(f"the sanity check before training: {what}: {error}") from None
    except Exception as error:  # noqa: BLE001 - a recipe's bug, said in one line before any training
        site = recipe_site(error)
        raise RecipeError(
            f"{what}, before training: {type(error).__name__}: {error}{f' ({site})' if site else ''}; fix it, or"
            " skip this check with sanity_eval=false"
        ) from None


def evaluate_baseline(run: Run, observer: Observer) -> None:
    """The evaluation before any training (step 0), with evaluations during the run: logged, and it checks
    keep_best_metric's name (the checkpointer saves nothing at step 0)."""
    started = time.perf_counter()
    scores = evaluate_run(run)
    observer.evaluation(0, scores, time.perf_counter() - started, describe_nonfinite(run.cfg, scores, 0))
    run.checkpointer.after_step(stop=False, scores=scores)


def evaluate_after(run: Run, observer: Observer, step: int) -> dict[str, float] | None:
    """The evaluation of `step` when one is due (every eval_every_steps, and at the end), logged; else None.

    Raises:
        UserError: an eval_metrics error (raised on every process), after saving the training up to `step`.
    """
    if run.data.eval_set is None or not evaluates_after(run.cfg, step):
        return None
    note_where("the evaluation after step", step)
    with run.data.prefetch_gate.paused():  # evaluation may share the training set's objects, and forks its workers
        started = time.perf_counter()
        try:
            scores = evaluate_run(run)
        except UserError as error:  # keep the training first
            folder = run.checkpointer.after_step(True, None, observer.pending_items())
            error.args = (f"{error} (the training up to step {step} is saved in {folder})",)
            raise
    observer.evaluation(step, scores, time.perf_counter() - started, describe_nonfinite(run.cfg, scores, step))
    run.checkpointer.state.metrics.update(scores)
    return scores
