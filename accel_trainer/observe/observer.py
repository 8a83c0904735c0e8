"""One owner of what a run records about itself while it trains.

The `Observer` holds metrics.jsonl and the console line (`MetricsLog`), events.jsonl, the trackers, the
device-side log window, FLOP counting, the profiler and the compile watch, and decides when a training record
is due. The loop tells it what happened (a step, an evaluation, a save) and reads nothing back; it takes
plain values, never the run, so observation sits below the loop and the prepared run in the import order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from accel_trainer.checkpoint.train_state import TrainState
from accel_trainer.config.eval_settings import evaluates_after
from accel_trainer.config.fields import parse_steps
from accel_trainer.config.train_config import TrainConfig, config_to_dict
from accel_trainer.contract.losses import LossOutput
from accel_trainer.observe.events import EventLog
from accel_trainer.observe.flops import to_meta
from accel_trainer.observe.metrics import MetricsLog
from accel_trainer.observe.profiling import StepProfiler
from accel_trainer.observe.report import write_report_or_warn
from accel_trainer.observe.trackers import Trackers
from accel_trainer.observe.window import ItemsSeen, Speed, Window, log_record
from accel_trainer.parallel.compiling import CompileWatch

PEAK_KEYS = {
    "host_rss_gb": "host {:.2f} GiB resident",
    "mem_allocated_gb": "device {:.2f} GiB allocated",
    "mem_reserved_gb": "{:.2f} GiB reserved",
}
"""The logged memory figures (observe/window.py: the largest process's peaks) whose run-long peak a run reports."""


def peak_memory_line(peaks: dict[str, float]) -> str:
    """`peak memory: host 2.66 GiB resident, device 9.10 GiB allocated, 9.50 GiB reserved (the largest process)`."""
    parts = [form.format(peaks[key]) for key, form in PEAK_KEYS.items() if key in peaks]
    return f"peak memory: {', '.join(parts)} (the largest process)"


class Observer:
    """The run's records: built once the run's state is known (after a resume), closed when training ends."""

    def __init__(
        self,
        *,
        accelerator: Accelerator,
        cfg: TrainConfig,
        run_dir: Path,
        state: TrainState,
        setup_started: float,
        speed: Speed,
        compiled: bool,
        count_flops: Callable[[Any], tuple[float, str]],
        items: ItemsSeen,
        nonfinite_steps: Callable[[], int],
        tracker_project: str = "",
    ) -> None:
        self.accelerator, self.cfg, self.run_dir, self.state = accelerator, cfg, run_dir, state
        self.speed, self.count_flops = speed, count_flops
        self.items, self.nonfinite_steps = items, nonfinite_steps
        main = accelerator.is_main_process
        trackers = None
        if main and cfg.trackers:
            config = config_to_dict(cfg)
            own = cfg.resume in ("auto", "none") or run_dir.resolve() in Path(cfg.resume).resolve().parents
            ids = state.tracker_ids if own else {}  # another folder's checkpoint: its runs are not this one's
            trackers = Trackers(cfg.trackers, run_dir, config, state.step, ids, tracker_project)
            state.tracker_ids = trackers.run_ids()
        self.events = EventLog(run_dir, enabled=main)
        self.events.write(
            "start", step=state.step, world_size=accelerator.num_processes, setup_s=time.time() - setup_started
        )
        self.log = MetricsLog(
            run_dir,
            enabled=main,
            total_steps=cfg.max_steps,
            show_progress_bar=cfg.show_progress_bar,
            initial=state.step,
            trackers=trackers,
        )
        self.compile_watch = CompileWatch(enabled=compiled, warn=main)
        self.profiler = StepProfiler(accelerator, run_dir, parse_steps(cfg.profile_steps))
        self.window = self._new_window()
        self.first_batch: Any = None  # the shapes of the first micro-batch (meta tensors), for counting FLOPs
        self.peaks: dict[str, float] = {}  # the run's peak memory so far, of the largest process (PEAK_KEYS)

    def close(self) -> None:
        self.log.close()

    def finish(self) -> None:
        """The run trained to its end: say so in events.jsonl with its peak memory, in one line too, and draw its
        report (unless report=false)."""
        self.events.write("end", step=self.state.step, **self.peaks)
        if self.accelerator.is_main_process and self.peaks:
            print(f"accel-trainer: {peak_memory_line(self.peaks)}", flush=True)
        if self.accelerator.is_main_process and self.cfg.report:
            write_report_or_warn(self.run_dir)

    # -- a training step ------------------------------------------------------------------------------------
    def logs_after(self, step: int) -> bool:
        """Whether `step` ends with a training record: every log_every_steps, at the end, and before an
        evaluation that may stop the run early."""
        cfg = self.cfg
        return (
            step == cfg.max_steps
            or (cfg.log_every_steps > 0 and step % cfg.log_every_steps == 0)
            or (bool(cfg.early_stop_metric) and evaluates_after(cfg, step))
        )

    def step_started(self, step: int) -> None:
        self.profiler.before_step(step)
        self.window.num_steps += 1

    def waited_for_data(self, seconds: float) -> None:
        self.window.data_wait_s += seconds

    def saw_batch(self, batch: Any) -> None:
        if self.first_batch is None:
            self.first_batch = to_meta(batch)

    def step_ended(self, step: int, outputs: list[LossOutput], micro_batch_size: int, counted: bool) -> None:
        """A step trained: its losses join the window unless the non-finite guard skipped it; FLOPs are counted
        after the first step, a start-up cost paid before training settles rather than inside a window."""
        if counted:  # a skipped step's losses stay out of the logged mean
            self.window.add_step(outputs, micro_batch_size)
        self.profiler.after_step(step)
        self.log.advance()
        if self.speed.flops_per_sample is None and self.first_batch is not None:
            started = time.perf_counter()
            flops, source = self.count_flops(self.first_batch)
            self.speed.flops_per_sample = flops
            self.log.note(f"accel-trainer: {flops:.4g} FLOPs per training sample ({source})")
            self.window.excluded_s += time.perf_counter() - started

    def record_training(self, figures: dict[str, Any]) -> None:
        """Read the window back into a record with the step's LRs and gradient norms, log it, keep it as the
        latest metrics, and open a new window."""
        state = self.state
        record, new_items = log_record(
            self.accelerator, self.cfg, self.window, state.step, state.epoch, figures, self.speed
        )
        self.items.seen += new_items
        record.update(
            skipped_steps=state.skipped_steps,
            nonfinite_steps=self.nonfinite_steps(),
            samples_seen=state.samples_seen,
            items_seen=self.items.seen,
            **self.compile_watch.record(state.step),
        )
        self.log.write(record)
        state.metrics.update(record)
        for key in PEAK_KEYS.keys() & record.keys():
            self.peaks[key] = max(self.peaks.get(key, 0.0), record[key])
        self.window = self._new_window()

    def _new_window(self) -> Window:
        """An empty window, whose items a save counts until it is logged (`ItemsSeen`)."""
        self.items.window = Window.empty(self.accelerator.device)
        return self.items.window

    # -- evaluations, saves, events --------------------------------------------------------------------------
    def evaluation(self, step: int, scores: dict[str, float], seconds: float, nonfinite_line: str) -> None:
        """An evaluation's record; the one before training (step 0) opens the first window after it, so its
        time is not training time."""
        self.window.excluded_s += seconds
        if step == 0:
            self.window = self._new_window()
        self.log.write({"step": step, **scores, "eval/seconds": seconds, "samples_seen": self.state.samples_seen})
        self.log.note(nonfinite_line)
        self.events.write("eval", step=step, seconds=seconds)
        if step > 0:  # the baseline is not a result of the training
            self.state.metrics.update(scores)

    def timed(self, work: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """`work(*args, **kwargs)` and the seconds it took, which the throughput window leaves out."""
        started = time.perf_counter()
        result = work(*args, **kwargs)
        seconds = time.perf_counter() - started
        self.window.excluded_s += seconds
        return result, seconds

    def event(self, event: str, **fields: Any) -> None:
        self.events.write(event, **fields)

    def note(self, line: str) -> None:
        self.log.note(line)
