"""Evaluation: the means of a recipe's per-sample eval metrics over the whole eval set, on any layout.

The `Evaluator` owns the run's evaluations and their cadence (`due(step)`): the sanity check before the first
step, the baseline before any training, and one every eval_every_steps and at the end, each logged by the
observer. `evaluate` is the whole-set mean itself, which `accel-trainer evaluate` uses too.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, send_to_device

from accel_trainer.checkpoint.checkpointer import Checkpointer
from accel_trainer.config.eval_settings import evaluates_after
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.contract.batch_rows import batch_size, first_rows
from accel_trainer.contract.eval_outputs import metric_sums
from accel_trainer.data.rng import rng_untouched
from accel_trainer.data.run_data import RunData
from accel_trainer.engine.benchmarks import TrainingBenchmarks
from accel_trainer.errors import RecipeError, UserError, recipe_site
from accel_trainer.observe.breadcrumb import note_where
from accel_trainer.observe.observer import Observer
from accel_trainer.optim.ema import WeightAverage
from accel_trainer.parallel.batchnorm import average_running_stats
from accel_trainer.recipe import Recipe

EvalMetrics = Callable[[torch.nn.Module, Any], Any]  # a recipe's eval_metrics, or a pipeline's


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
    accelerator: Accelerator, eval_metrics: EvalMetrics, model: torch.nn.Module, batches: Any, padded: bool
) -> dict[str, float]:
    """The recipe's eval metrics over the whole eval set, each sample counted once (`eval_metrics`: the recipe's,
    or on a pipeline layout the pipeline's, which runs the recipe's on its last stage).

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
            output = eval_metrics(model, first_rows(batch, rows) if 0 < rows < size else batch)
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


class Evaluator:
    """The run's evaluations: built once by preparation with what they need, asked by the loop when one is due."""

    def __init__(
        self,
        *,
        accelerator: Accelerator,
        eval_metrics: EvalMetrics,
        model: torch.nn.Module,
        data: RunData,
        cfg: TrainConfig,
        checkpointer: Checkpointer,
        ema: WeightAverage | None = None,
        benchmarks: TrainingBenchmarks | None = None,
    ) -> None:
        self.accelerator, self.eval_metrics, self.model, self.data = accelerator, eval_metrics, model, data
        self.cfg, self.checkpointer, self.ema, self.benchmarks = cfg, checkpointer, ema, benchmarks

    @property
    def has_eval(self) -> bool:
        return self.data.eval_set is not None

    @property
    def evaluates(self) -> bool:
        """Whether there is anything to evaluate: the recipe's eval set, or benchmark tasks (eval_tasks)."""
        return self.has_eval or self.benchmarks is not None

    def baseline_due(self, step: int) -> bool:
        """Whether the run evaluates before training (step 0), as it does when it evaluates during training."""
        return self.evaluates and self.cfg.eval_every_steps > 0 and step == 0

    def due(self, step: int) -> bool:
        """Whether an evaluation follows `step`: every eval_every_steps, and at the end."""
        return self.evaluates and evaluates_after(self.cfg, step)

    def scores(self) -> dict[str, float]:
        """The run's eval metrics (`eval/<name>`), with evaluate_ema its EMA weights' (`eval_ema/<name>`), and with
        eval_tasks the benchmarks' of the weights (`lm_eval/<task>/<metric>`); the random streams are left as they
        were, so training does not depend on when it evaluates."""
        scores: dict[str, float] = {}
        with rng_untouched():
            if self.has_eval:
                scores = evaluate(self.accelerator, self.eval_metrics, self.model, *self.data.eval_batches())
            if self.has_eval and self.cfg.evaluate_ema and self.ema is not None:
                with self.ema.swapped_in():
                    averaged = evaluate(self.accelerator, self.eval_metrics, self.model, *self.data.eval_batches())
                scores.update({"eval_ema/" + name.removeprefix("eval/"): value for name, value in averaged.items()})
            if self.benchmarks is not None:
                scores.update(self.benchmarks.scores())
        return scores

    def evaluate(self, step: int, observer: Observer) -> dict[str, float]:
        """The evaluation after `step` (0: the baseline before any training), logged.

        Raises:
            UserError: an eval_metrics error (raised on every process), after saving the training up to `step`.
        """
        if step == 0:
            started = time.perf_counter()
            scores = self.scores()
        else:
            note_where("the evaluation after step", step)
            with self.data.prefetch_gate.paused():  # evaluation may share the training set's objects, forks workers
                started = time.perf_counter()
                try:
                    scores = self.scores()
                except UserError as error:  # keep the training first
                    folder = self.checkpointer.after_step(stop=True, scores=None)
                    error.args = (f"{error} (the training up to step {step} is saved in {folder})",)
                    raise
        observer.evaluation(step, scores, time.perf_counter() - started, describe_nonfinite(self.cfg, scores, step))
        return scores

    def sanity_check(self, step: int) -> None:
        """The recipe's eval metrics on the eval set's first micro-batch, before step `step` (`sanity_eval`): an eval
        set with no example, a collate or a metric that fails, or a metric the loop cannot read is a one-line error
        now, not after the training. Every process runs the same batch (a sharded forward is collective); the random
        streams and the model's mode are left as they were, so the training does not change.

        Raises:
            RecipeError: naming what failed (the exception and where, for a recipe's bug).
        """
        if not self.cfg.sanity_eval or not self.has_eval:
            return
        note_where("the sanity check of eval_metrics before step", step)
        examples = self.data.first_eval_examples()
        if not examples:
            raise RecipeError("the eval set holds no example: give it some (or build_datasets may return None as eval)")
        with _said_in_one_line("collate fails on the first eval examples"):
            batch = send_to_device(self.data.collate(examples), self.accelerator.device)
        with _said_in_one_line(f"{self._what_evaluates()} fails on the first eval batch"), rng_untouched():
            evaluate(self.accelerator, self.eval_metrics, self.model, [batch], padded=False)

    def _what_evaluates(self) -> str:
        """The recipe function an evaluation runs: its eval_metrics, or, where it keeps Recipe's, compute_loss
        (Recipe.eval_metrics reports its loss), so that a bug in compute_loss is not blamed on eval_metrics."""
        default = getattr(self.eval_metrics, "__func__", None) is Recipe.eval_metrics
        return "compute_loss (the eval loss: the recipe has no eval_metrics of its own)" if default else "eval_metrics"


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
