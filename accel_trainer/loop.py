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
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from accel_trainer.checkpoint.save import RunIdentity
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig, config_to_yaml, layout_to_yaml
from accel_trainer.data.loaders import describe_path
from accel_trainer.evaluation import evaluate_after, evaluate_baseline
from accel_trainer.observe.breadcrumb import note_where
from accel_trainer.observe.flops import flops_per_sample
from accel_trainer.observe.header import header, parameters_held, write_run_info
from accel_trainer.observe.metrics import drop_records_after, format_metric
from accel_trainer.observe.observer import Observer
from accel_trainer.observe.profiling import dump_out_of_memory
from accel_trainer.observe.window import Speed
from accel_trainer.parallel.mesh import tensor_parallel_size
from accel_trainer.prepared_run import Run, prepare_run
from accel_trainer.recipe import Recipe
from accel_trainer.stopping.early import check_early_stop
from accel_trainer.stopping.signals import PreemptionWatcher
from accel_trainer.stopping.stop import Stopping
from accel_trainer.training_step import train_step


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
    run = prepare_run(recipe, RunIdentity(recipe_name, cfg, layout), accelerator, run_dir)
    state = run.restore()
    check_early_stop(cfg, run.data.eval_set is not None)
    if state.step >= cfg.max_steps or state.stopped_early:  # the run's files stay as they are: nothing trains
        return _already_trained(run)
    _write_run_files(run, cfg, layout, recipe_name)
    observer = _observer(run, cfg, setup_started)  # the config as asked (micro_batch_size=auto stays auto)
    try:
        timeout_s = layout.collective_timeout_s
        preemption = PreemptionWatcher(accelerator.num_processes, timeout_s, cfg.max_time, setup_started)
        with Stopping(run.cfg, run.guard, preemption) as stopping, contextlib.closing(run.micro_batches()) as batches:
            final = _train_steps(run, batches, observer, stopping)  # the micro-batches may hold a prefetch thread
    except torch.cuda.OutOfMemoryError:
        print(
            f"accel-trainer: out of CUDA memory; what it held: {dump_out_of_memory(run_dir, accelerator)}", flush=True
        )
        raise
    finally:
        observer.close()
        run.checkpointer.close()  # never leave with a checkpoint half written, preempted or not
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
        if (position := run.data.stream_position()) is not None:  # a map-style set's follows from the step
            state.data_position = position
        pending = None if is_log_step else observe.pending_items()
        folder, seconds = observe.timed(
            run.checkpointer.after_step, stop is not None, scores, count_pending_items=pending
        )
        if folder is not None:
            observe.event("checkpoint", step=step, seconds=seconds, background=run.checkpointer.writer is not None)
        if stop is not None:
            return stopping.end(stop, state, folder, observe)
    return state.metrics


def _already_trained(run: Run) -> dict[str, Any]:
    """Say that a resumed run has nothing left to train; write its final weights if they are missing."""
    state, max_steps = run.checkpointer.state, run.cfg.max_steps
    if run.accelerator.is_main_process:
        summary = " | ".join(format_metric(key, value) for key, value in state.metrics.items())
        reached = "stopped early at" if state.stopped_early else "already reached"
        print(
            f"{run.run_dir} {reached} step {state.step} of max_steps={max_steps}: nothing to train;"
            f" its final metrics: {summary}",
            flush=True,
        )
    if not (run.run_dir / "final").is_dir():  # stopped between its last checkpoint and its final weights
        run.final_weights()
    return state.metrics


def _write_run_files(run: Run, cfg: TrainConfig, layout: LayoutSettings, recipe_name: str) -> None:
    """config.yaml, layout.yaml, model_summary.txt and run_info.json, once the checkpoint (if any) is accepted,
    and the header on the console; records after the resumed step go (a later run rewrites them)."""
    accelerator, run_dir, state = run.accelerator, run.run_dir, run.checkpointer.state
    held = parameters_held(run.model, accelerator)  # a collective: on every process
    if not accelerator.is_main_process:
        return
    ran = replace(layout, tp_size=tensor_parallel_size(accelerator))  # also when the accelerate config set it
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    (run_dir / "layout.yaml").write_text(layout_to_yaml(ran))
    (run_dir / "model_summary.txt").write_text(run.model_summary)
    write_run_info(run_dir, accelerator, ran, state.step, held)
    drop_records_after(run_dir, state.step)
    data_path = describe_path(run.data.train_loader, run.recipe)
    print(header(accelerator, recipe_name, run.num_parameters, held, run.plan, data_path, run_dir), flush=True)


def _observer(run: Run, cfg: TrainConfig, setup_started: float) -> Observer:
    phases = tuple(p.name for p in run.optimizers.phases) if run.optimizers.alternate else (None,)

    def count_flops(first_batch: Any) -> tuple[float, str]:
        return flops_per_sample(run.recipe, run.cfg, first_batch, run.num_parameters, phases)

    return Observer(
        accelerator=run.accelerator,
        cfg=cfg,
        run_dir=run.run_dir,
        state=run.checkpointer.state,
        setup_started=setup_started,
        speed=Speed(peak_tflops=run.peak_tflops),
        compiled=run.compiled,
        count_flops=count_flops,
    )
