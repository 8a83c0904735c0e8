"""The training loop: one module, read top to bottom, speaking the step verbs of the layout.

`train_loop` prepares the run, resumes it if asked, and hands over to `_train_steps`, whose body is the step
order, once per optimizer step:
    accumulation_steps x (forward, loss, backward under `accumulate`)  ->  normalise  ->  clip
    ->  optimizer step  ->  LR schedule  ->  zero grad  ->  log  ->  evaluate  ->  checkpoint / stop

Each part owns its cadence and its records: the `Observer` (observe/observer.py) when a training record is due
and everything written about the run, evaluation.py when an evaluation is due, the checkpointer when a save is,
and `Stopping` (stopping/stop.py) whether the run ends after this step. Nothing here reads a tensor back to the
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

from accel_trainer.checkpoint.trained import RunIdentity
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.engine.evaluator import evaluate_after, evaluate_baseline, sanity_check
from accel_trainer.engine.heap import setup_left_out_of_collections
from accel_trainer.engine.preparation import Run, prepare_run
from accel_trainer.engine.stepper import train_step
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
) -> dict[str, Any]:
    """Train `recipe` up to `cfg.max_steps` optimizer steps, resuming if asked, and return the final metrics.

    Raises:
        Preempted: a signal stopped the run after it saved a checkpoint.
    """
    setup_started = time.time()
    module = sys.modules.get(type(recipe).__module__)  # no file for a recipe typed in a notebook or `python -c`
    identity = RunIdentity(recipe_name, cfg, layout, getattr(module, "__file__", None))
    run = prepare_run(recipe, identity, accelerator, run_dir)
    state = run.restore()  # a position the data cannot continue from is refused before the run folder changes
    check_early_stop(cfg, run.data.eval_set is not None)
    if state.step >= cfg.max_steps or state.stopped_early:  # the run's files stay as they are: nothing trains
        return run.already_trained()
    sanity_check(run)  # a broken eval metric is refused before the run folder holds a run
    run.write_start_files(cfg, layout, recipe_name)
    observer = run.observer(cfg, setup_started)
    try:
        timeout_s = layout.collective_timeout_s
        preemption = PreemptionWatcher(accelerator.num_processes, timeout_s, cfg.max_time, setup_started)
        with (
            setup_left_out_of_collections(),
            Stopping(run.cfg, run.guard, preemption) as stopping,
            contextlib.closing(run.micro_batches()) as batches,  # the micro-batches may hold a prefetch thread
        ):
            final = _train_steps(run, batches, observer, stopping)
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
    run.final_weights()
    observer.finish()
    return final


def _train_steps(run: Run, batches: Any, observe: Observer, stopping: Stopping) -> dict[str, Any]:
    """The step order of the module docstring, once per optimizer step, from the restored step on."""
    cfg, state = run.cfg, run.checkpointer.state
    if run.data.eval_set is not None and cfg.eval_every_steps > 0 and state.step == 0:
        evaluate_baseline(run, observe)
    run.model.train()
    for step in range(state.step + 1, cfg.max_steps + 1):
        observe.step_started(step)
        is_log_step = observe.logs_after(step)
        outputs, figures = train_step(run, batches, observe, step, is_log_step)
        counted = run.guard is None or not state.nonfinite_in_a_row  # a skipped step stays out of the logged mean
        observe.step_ended(step, outputs, run.plan.micro_batch_size, counted)
        gives_up = stopping.gives_up(state)
        if is_log_step or gives_up:  # a stop on non-finite steps records the steps since the last record
            observe.record_training(figures if is_log_step else {**run.optimizers.current_lrs(), **figures})
        scores = evaluate_after(run, observe, step)
        stop = stopping.after_step(state, scores)
        note_where("the save of step", step)
        pending = None if is_log_step else observe.pending_items()
        folder, seconds = observe.timed(
            run.checkpointer.after_step, stop is not None, scores, pending, run.data.stream_position
        )
        if folder is not None:  # seconds: how long training was blocked, waiting for an earlier write included
            observe.event("checkpoint", step=step, seconds=seconds, background=run.checkpointer.writer is not None)
        for written in run.checkpointer.background_writes():
            observe.event("checkpoint_written", **written)
        if stop is not None:
            return stopping.end(stop, state, folder, observe)
    return state.metrics
