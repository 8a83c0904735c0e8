"""The training loop: one module, read top to bottom, speaking the step verbs of the layout.

`train_loop` prepares the run, resumes it if asked, and hands over to `_train_steps`, whose body is the step
order, once per optimizer step:
    accumulation_steps x (forward, loss, backward under `accumulate`)  ->  normalise  ->  clip
    ->  optimizer step  ->  LR schedule  ->  zero grad  ->  log  ->  evaluate  ->  checkpoint / stop

Each part owns its cadence and its records: the `Stepper` (engine/stepper.py) the step itself, the `Observer`
(observe/observer.py) when a training record is due and everything written about the run, the `Evaluator`
(engine/evaluator.py) when an evaluation is due, the checkpointer when a save is, and `Stopping`
(stopping/stop.py) whether the run ends after this step. Nothing here reads a tensor back to the
host except on logging, evaluation and save steps, so the device never waits on Python between them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from accel_trainer.checkpoint.checkpointer import Checkpointer
from accel_trainer.checkpoint.trained import RunIdentity
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.engine.evaluator import Evaluator
from accel_trainer.engine.heap import setup_left_out_of_collections
from accel_trainer.engine.preparation import prepare_run
from accel_trainer.engine.run import Run
from accel_trainer.engine.stepper import Stepper
from accel_trainer.observe.breadcrumb import note_where
from accel_trainer.observe.observer import Observer
from accel_trainer.observe.profiling import dump_out_of_memory
from accel_trainer.recipe import Recipe
from accel_trainer.stopping.early import check_early_stop
from accel_trainer.stopping.signals import PreemptionWatcher
from accel_trainer.stopping.stop import Stopping


def train_loop(
    recipe: Recipe,
    cfg: TrainConfig,
    layout: LayoutSettings,
    accelerator: Accelerator,
    run_dir: Path,
    recipe_name: str,
    micro_batch_size_given: bool = True,
) -> dict[str, Any]:
    """Train `recipe` up to `cfg.max_steps` optimizer steps, resuming if asked, and return the final metrics;
    `micro_batch_size_given`: False where cfg's is the recipe's default, which follows the layout.

    Raises:
        Preempted: a signal stopped the run after it saved a checkpoint.
    """
    setup_started = time.time()
    recipe.run_dir = run_dir
    module = sys.modules.get(type(recipe).__module__)  # no file for a recipe typed in a notebook or `python -c`
    identity = RunIdentity(recipe_name, cfg, layout, getattr(module, "__file__", None), micro_batch_size_given)
    run = prepare_run(recipe, identity, accelerator, run_dir)
    run.checkpointer.restore()  # a position the data cannot continue from is refused before the run folder changes
    check_early_stop(cfg, run.evaluator.has_eval)
    if run.progress.step >= cfg.max_steps or run.early.stopped_early:  # the run's files stay: nothing trains
        return run.already_trained()
    run.evaluator.sanity_check(run.progress.step + 1)  # a broken eval metric is refused before the folder holds a run
    run.write_start_files(cfg, layout, recipe_name)
    observer = run.observer(cfg, setup_started)
    try:
        timeout_s = layout.collective_timeout_s
        preemption = PreemptionWatcher(accelerator.num_processes, timeout_s, cfg.max_time, setup_started)
        with (
            setup_left_out_of_collections(),
            Stopping(run.cfg, run.stepper.guard, run.early, preemption) as stopping,
            contextlib.closing(run.micro_batches()) as batches,  # the micro-batches may hold a prefetch thread
        ):
            _train_steps(run.stepper, run.evaluator, run.checkpointer, stopping, observer, batches, cfg.max_steps)
    except torch.cuda.OutOfMemoryError:
        print(
            f"accel-trainer: out of CUDA memory; what it held: {dump_out_of_memory(run_dir, accelerator)}", flush=True
        )
        raise
    finally:
        observer.close()
        run.checkpointer.close()  # never leave with a checkpoint half written, preempted or not
        for written in run.checkpointer.background_writes():
            observer.event("checkpoint_written", **written)
    _write_final_weights(run, observer, accelerator.is_main_process)
    observer.finish()
    return run.progress.metrics


def _write_final_weights(run: Run, observer: Observer, main_process: bool) -> None:
    """final/, announced as it begins (a LoRA merge and a whole model's write: seconds to minutes of an otherwise
    quiet end) and timed in events.jsonl, where the report sets it apart from training."""
    if main_process:
        print(
            f"accel-trainer: writing the final weights and the recipe's artifacts to {run.run_dir / 'final'}",
            flush=True,
        )
    _, seconds = observer.timed(run.final_weights)
    observer.event("final", step=run.progress.step, seconds=round(seconds, 3))


def _train_steps(
    stepper: Stepper,
    evaluator: Evaluator,
    checkpointer: Checkpointer,
    stopping: Stopping,
    observe: Observer,
    batches: Any,
    max_steps: int,
) -> None:
    """The step order of the module docstring, once per optimizer step, from the restored step on: each part
    asked in turn, none of them given the whole run."""
    progress = stepper.progress
    if evaluator.baseline_due(progress.step):  # logged; checks keep_best_metric's name (nothing is saved)
        checkpointer.after_step(stop=False, scores=evaluator.evaluate(0, observe))
    stepper.model.train()
    for step in range(progress.step + 1, max_steps + 1):
        observe.step_started(step)
        is_log_step = observe.logs_after(step)
        outputs, figures = stepper.step(batches, observe, step, is_log_step)
        observe.step_ended(step, outputs, stepper.plan.micro_batch_size, stepper.counted())
        gives_up = stopping.gives_up()
        if is_log_step or gives_up:  # a stop on non-finite steps records the steps since the last record
            observe.record_training(figures if is_log_step else {**stepper.optimizers.current_lrs(), **figures})
        scores = evaluator.evaluate(step, observe) if evaluator.due(step) else None
        stop = stopping.after_step(step, scores)
        note_where("the save of step", step)
        folder, seconds = observe.timed(checkpointer.after_step, stop is not None, scores)
        if folder is not None:  # seconds: how long training was blocked, waiting for an earlier write included
            observe.event("checkpoint", step=step, seconds=seconds, background=checkpointer.writer is not None)
        for written in checkpointer.background_writes():
            observe.event("checkpoint_written", **written)
        if stop is not None:
            stopping.end(stop, step, folder, observe)
            return
