"""Metrics output of the main process: `metrics.jsonl` in the run folder, a console line, a progress bar.

Only the main process writes; other processes get a `MetricsLog` that does nothing, so the loop can call it
unconditionally. Every record is one JSON object per line, flushed at once so a crash loses nothing.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from accel_trainer.observe.number_format import readable
from accel_trainer.observe.trackers import Trackers

STATUS_EVERY_S = 30.0


class MetricsLog:
    """Appends records to `metrics.jsonl` and echoes them; a no-op off the main process."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        show_progress_bar: bool,
        initial: int = 0,
        trackers: Trackers | None = None,
    ) -> None:
        self.enabled = enabled
        self.trackers = trackers
        # Kept open for the whole run (line-buffered, closed by close()); a `with` block cannot span the loop.
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1) if enabled else None  # noqa: SIM115
        on_terminal = sys.stderr.isatty()
        self._bar = tqdm(
            total=total_steps,
            initial=initial,
            disable=not (enabled and show_progress_bar and on_terminal),
            dynamic_ncols=True,
            unit="step",
        )
        # In a log file a bar is noise: a status line at most every STATUS_EVERY_S instead.
        self._status = enabled and show_progress_bar and not on_terminal
        self._step, self._total, self._started_at = initial, total_steps, initial
        self._started = self._last_status = time.monotonic()

    def advance(self) -> None:
        """Move the progress by one optimizer step (cheap; no device synchronisation)."""
        self._bar.update(1)
        self._step += 1
        now = time.monotonic()
        if self._status and now - self._last_status >= STATUS_EVERY_S and self._step < self._total:
            self._last_status = now
            rate = (self._step - self._started_at) / (now - self._started)
            eta = _duration((self._total - self._step) / rate) if rate > 0 else "?"
            print(f"step {self._step}/{self._total} ({100 * self._step / self._total:.0f}%) | eta {eta}", flush=True)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)
        if "loss" in record and not self._bar.disable:  # the bar carries the latest figures between log lines
            self._bar.set_postfix(
                {k: readable(record[k]) for k in ("loss", "lr", "items_per_s") if k in record}, refresh=False
            )
        message = console_line(record)
        if self._bar.disable:
            print(message, flush=True)
        else:
            self._bar.write(message)

    def note(self, message: str) -> None:
        """Print a line of information about the run (main process only), around the progress bar."""
        if not self.enabled or not message:
            return
        if self._bar.disable:
            print(message, flush=True)
        else:
            self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
        if self.trackers is not None:
            self.trackers.finish()
        if self._file is not None:
            self._file.close()


def drop_records_after(run_dir: Path, step: int) -> None:
    """Make `metrics.jsonl` end at `step`, where a run resumes, so its steps are never logged twice.

    A run killed after its last checkpoint logged steps it will train again; those records are dropped
    (the file is replaced atomically) and appended to `metrics.dropped.jsonl`. Starting from step 0 in a
    folder that has records (the first attempt died before its first checkpoint) sets the old file aside as
    `metrics.abandoned.jsonl`.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    if step == 0:
        if path.stat().st_size:  # an empty file holds nothing worth setting aside
            path.replace(run_dir / "metrics.abandoned.jsonl")
        else:
            path.unlink()
        return
    kept: list[str] = []
    dropped: list[str] = []
    unreadable = 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            (kept if json.loads(line)["step"] <= step else dropped).append(line)
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash, or a damaged file
            unreadable += 1
    if unreadable:
        warnings.warn(
            f"accel-trainer: {path}: dropped {unreadable} unreadable line(s) (cut short or damaged)", stacklevel=2
        )
    if dropped:  # kept aside, in case the lost steps are of interest
        with open(run_dir / "metrics.dropped.jsonl", "a") as aside:
            aside.write("".join(line + "\n" for line in dropped))
    temporary = path.with_name("metrics.jsonl.tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    temporary.replace(path)


# Kept in metrics.jsonl, left off the console line: what a reader does not watch step by step.
_NOT_ON_CONSOLE = {
    "samples_per_s",
    "step_time_s",
    "step_time_s_max",
    "step_time_s_min",
    "world_size",
    "tflops",
    "host_rss_gb",
    "mem_reserved_gb",
    "samples_seen",
    "items_seen",
    "data_wait_frac",
}
_SHOWN_WHEN_NONZERO = {"skipped_steps", "nonfinite_steps"}


def console_line(record: dict[str, Any]) -> str:
    """The short form of a record: what changes, formatted for reading; the full record is in metrics.jsonl."""
    shown = []
    for key, value in record.items():
        hidden = key in _NOT_ON_CONSOLE or key.startswith("lr/") or (key in _SHOWN_WHEN_NONZERO and not value)
        if hidden and not (key == "data_wait_frac" and value > 0.1):  # waiting for data is worth a mention
            continue
        shown.append(f"eta {_duration(value)}" if key == "eta_s" else format_metric(key, value))
    return " | ".join(shown)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_metric(key: str, value: Any) -> str:
    """`key value` as the console shows it (number_format.readable: 4 significant digits, or whole from 10,000)."""
    if isinstance(value, float):
        return f"{key} {readable(value)}"
    return f"{key} {value}"
