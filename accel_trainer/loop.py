"""The training loop: one module, read top to bottom, speaking the step verbs of the layout.

`train_loop` prepares the run, asks the checkpointer to resume it if asked, and hands over to `_train_steps`,
whose body is the step order, once per optimizer step:
    accumulation_steps x (forward, loss, backward under `accumulate`)  ->  normalise  ->  clip
    ->  optimizer step  ->  LR schedule  ->  zero grad  ->  log  ->  evaluate  ->  checkpoint / stop

Nothing here reads a tensor back to the host except on logging, evaluation and save steps, so the device
never waits on Python between them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from .checkpoint import RunIdentity
from .config import TrainConfig, config_to_dict, config_to_yaml, layout_to_yaml
from .early_stopping import check_early_stop, should_stop_early
from .errors import UserError
from .evaluation import describe_nonfinite, evaluate_run, evaluates_after
from .events import EventLog
from .layout import LayoutSettings
from .mesh import tensor_parallel_size
from .metrics import MetricsLog, drop_records_after, format_metric
from .preemption import Preempted, PreemptionWatcher, note_where
from .prepared_run import Run, micro_batches, prepare_run
from .profiling import StepProfiler, dump_out_of_memory, parse_steps
from .recipe import Recipe
from .report import write_report_or_warn
from .run_info import header, parameters_held, write_run_info
from .step_log import Window, count_flops_once, write_log_record
from .trackers import Trackers
from .training_step import train_step


def train_loop(
    recipe: Recipe, cfg: TrainConfig, layout: LayoutSettings, accelerator: Accelerator, run_dir: Path,
    recipe_name: str,
) -> dict[str, Any]:  # fmt: skip
    """Train `recipe` up to `cfg.max_steps` optimizer steps, resuming if asked, and return the final metrics.

    Raises:
        Preempted: a signal stopped the run after it saved a checkpoint.
    """
    setup_started = time.time()
    run = prepare_run(recipe, RunIdentity(recipe_name, cfg, layout), accelerator, run_dir)
    state = run.restore()
    check_early_stop(cfg, run.eval_set is not None)
    if state.step >= cfg.max_steps or state.stopped_early:  # the run's files stay as they are: nothing is trained
        return _already_trained(run)
    held = parameters_held(run.model, accelerator)
    ran = replace(layout, tp_size=tensor_parallel_size(accelerator))  # also when the accelerate config set it
    if accelerator.is_main_process:  # only once the checkpoint (if any) has been accepted
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
        (run_dir / "layout.yaml").write_text(layout_to_yaml(ran))
        (run_dir / "model_summary.txt").write_text(run.model_summary)
        write_run_info(run_dir, accelerator, ran, state.step, held)
        drop_records_after(run_dir, state.step)
        print(header(run, recipe_name, held), flush=True)
    trackers = None
    if accelerator.is_main_process and cfg.trackers:
        trackers = Trackers(cfg.trackers, run_dir, config_to_dict(cfg), state.step, state.tracker_ids)
        state.tracker_ids = trackers.run_ids()
    run.events = EventLog(run_dir, enabled=accelerator.is_main_process)
    run.events.write("start", step=state.step, world_size=accelerator.num_processes,
                     setup_s=time.time() - setup_started)  # fmt: skip
    log = MetricsLog(run_dir, enabled=accelerator.is_main_process, total_steps=cfg.max_steps,
                     show_progress_bar=cfg.show_progress_bar, initial=state.step, trackers=trackers)  # fmt: skip
    try:
        watcher = PreemptionWatcher(accelerator.num_processes, layout.collective_timeout_s, cfg.max_time,
                                    setup_started)  # fmt: skip
        with watcher as preemption, contextlib.closing(micro_batches(run)) as batches:  # a prefetch thread too
            final = _train_steps(run, batches, log, preemption)
    except torch.cuda.OutOfMemoryError:
        print(f"accel-trainer: out of CUDA memory; what it held: {dump_out_of_memory(run_dir, accelerator)}",
              flush=True)  # fmt: skip
        raise
    finally:
        log.close()
        run.checkpointer.close()  # never leave with a checkpoint half written, preempted or not
    run.final_weights()
    run.events.write("end", step=run.checkpointer.state.step)
    if accelerator.is_main_process:
        write_report_or_warn(run_dir)
    return final


def _already_trained(run: Run) -> dict[str, Any]:
    """Say that a resumed run has nothing left to train; write its final weights if they are missing."""
    state, max_steps = run.checkpointer.state, run.cfg.max_steps
    if run.accelerator.is_main_process:
        summary = " | ".join(format_metric(key, value) for key, value in state.metrics.items())
        reached = "stopped early at" if state.stopped_early else "already reached"
        print(f"{run.run_dir} {reached} step {state.step} of max_steps={max_steps}: nothing to train;"
              f" its final metrics: {summary}", flush=True)  # fmt: skip
    if not (run.run_dir / "final").is_dir():  # stopped between its last checkpoint and its final weights
        run.final_weights()
    return state.metrics


def _train_steps(run: Run, batches: Any, log: MetricsLog, preemption: PreemptionWatcher) -> dict[str, Any]:
    """The step loop: accumulate, clip, step, schedule, log, evaluate, checkpoint, stop on a signal."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    state = run.checkpointer.state
    has_eval = run.eval_set is not None
    if has_eval and cfg.eval_every_steps > 0 and state.step == 0:
        _evaluate_baseline(run, log)
    window = Window.empty(accelerator.device)  # after the baseline evaluation: its time is not training time
    profiler = StepProfiler(accelerator, run.run_dir, parse_steps(cfg.profile_steps))
    model.train()
    for step in range(state.step + 1, cfg.max_steps + 1):
        profiler.before_step(step)
        is_log_step = _logs_after(cfg, step)
        outputs, figures = train_step(run, batches, window, step, is_log_step)
        if run.guard is None or not state.nonfinite_in_a_row:  # a skipped step's losses stay out of the logged mean
            window.add_step(outputs, run.plan.micro_batch_size)
        profiler.after_step(step)
        log.advance()
        count_flops_once(run, log, window)

        gives_up = run.guard is not None and run.guard.gives_up(state)
        if is_log_step or gives_up:  # a stop on non-finite steps records the steps since the last record
            if not is_log_step:  # the LRs, unchanged by the skipped steps
                figures = {**run.optimizers.current_lrs(), **figures}
            write_log_record(run, log, window, figures)
            window = Window.empty(accelerator.device)
        scores = _evaluate_after(run, log, window, step) if has_eval else None
        early_stop = should_stop_early(cfg, state, scores)
        stop = preemption.should_stop()
        note_where("the save of step", step)
        if run.stream is not None:  # a map-style set's position is derived from the step
            state.data_position = list(run.stream.position)
        pending = None if is_log_step else functools.partial(window.bank_items, accelerator)
        folder, seconds = _timed(run.checkpointer.after_step, stop or bool(early_stop) or gives_up, scores,
                                 count_pending_items=pending)  # fmt: skip
        window.excluded_s += seconds
        if folder is not None:
            _event(run, "checkpoint", step=step, seconds=seconds, background=run.checkpointer.writer is not None)
        if gives_up:
            _event(run, "nonfinite_stop", step=step)
            raise run.guard.error(state, folder)  # type: ignore[union-attr]
        if stop:
            _event(run, "preempted", step=step, signal=preemption.signal_name)
            raise Preempted(preemption.signal_name, step, folder)
        if early_stop:
            _event(run, "early_stop", step=step)
            log.note(f"accel-trainer: {early_stop}; checkpoint {folder}")
            break
    return state.metrics


def _logs_after(cfg: TrainConfig, step: int) -> bool:
    """Whether `step` ends with a training record: every log_every_steps, at the end, and before an evaluation
    that may stop the run early."""
    return (
        step == cfg.max_steps
        or (cfg.log_every_steps > 0 and step % cfg.log_every_steps == 0)
        or (bool(cfg.early_stop_metric) and evaluates_after(cfg, step))
    )


def _evaluate_baseline(run: Run, log: MetricsLog) -> None:
    """The evaluation before any training (step 0), logged; it checks keep_best_metric's name and saves nothing."""
    baseline, seconds = _timed(evaluate_run, run)
    log.write({"step": 0, **baseline, "eval/seconds": seconds, "samples_seen": 0})
    log.note(describe_nonfinite(run.cfg, baseline, 0))
    _event(run, "eval", step=0, seconds=seconds)
    run.checkpointer.after_step(stop=False, scores=baseline)


def _evaluate_after(run: Run, log: MetricsLog, window: Window, step: int) -> dict[str, float] | None:
    """The evaluation of `step` when one is due (every eval_every_steps, and at the end), logged; else None."""
    cfg, state = run.cfg, run.checkpointer.state
    if not evaluates_after(cfg, step):
        return None
    note_where("the evaluation after step", step)
    with run.prefetch_gate.paused():  # evaluation may share the training set's objects, and forks its workers
        try:
            scores, seconds = _timed(evaluate_run, run)
        except UserError as error:  # an eval_metrics error (raised on every process): keep the training first
            folder = run.checkpointer.after_step(True, None, functools.partial(window.bank_items, run.accelerator))
            error.args = (f"{error} (the training up to step {step} is saved in {folder})",)
            raise
    window.excluded_s += seconds
    log.write({"step": step, **scores, "eval/seconds": seconds, "samples_seen": state.samples_seen})
    log.note(describe_nonfinite(cfg, scores, step))
    _event(run, "eval", step=step, seconds=seconds)
    state.metrics.update(scores)
    return scores


def _event(run: Run, event: str, **fields: Any) -> None:
    if run.events is not None:
        run.events.write(event, **fields)


def _timed(work: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """`work(*args, **kwargs)` and the seconds it took (for what the throughput window excludes)."""
    started = time.perf_counter()
    result = work(*args, **kwargs)
    return result, time.perf_counter() - started
