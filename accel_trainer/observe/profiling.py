"""Profiling chosen optimizer steps, and a memory dump when CUDA runs out of memory.

`profile_steps=5-8` profiles optimizer steps 5 to 8 on every process with accelerate's profiler
(`Accelerator.profile` with `ProfileKwargs`: torch.profiler, CPU and CUDA activities, shapes and memory), and
writes into `<run>/profile/`: a chrome trace per rank (`profile_<rank>.json`, open it in chrome://tracing or
Perfetto), the op table sorted by self time (`ops_rank<r>.txt`), and on CUDA a memory snapshot
(`memory_rank<r>.pickle`, for pytorch.org/memory_viz). A CUDA out-of-memory error writes
`<run>/oom_rank<r>.txt` (torch's memory summary, and the snapshot when one was being recorded) before it is
raised again.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProfileKwargs


class StepProfiler:
    """Starts accelerate's profiler before the first chosen step and writes its files after the last."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, steps: tuple[int, int] | None) -> None:
        self.accelerator, self.folder, self.steps = accelerator, run_dir / "profile", steps
        self._open: contextlib.ExitStack | None = None
        self._profiler: Any = None

    def before_step(self, step: int) -> None:
        if self.steps is None or step != self.steps[0]:
            return
        on_cuda = self.accelerator.device.type == "cuda"
        handler = ProfileKwargs(
            activities=["cpu", "cuda"] if on_cuda else ["cpu"],
            record_shapes=True,
            profile_memory=True,
            output_trace_dir=str(self.folder),
        )
        if on_cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._open = contextlib.ExitStack()
        self._profiler = self._open.enter_context(self.accelerator.profile(handler))

    def after_step(self, step: int) -> None:
        if self._open is None or self.steps is None or step != self.steps[1]:
            return
        self._open.close()  # exports the chrome trace; every process passes here at the same step
        self._open = None
        rank = self.accelerator.process_index
        table = self._profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (self.folder / f"ops_rank{rank}.txt").write_text(table)
        if self.accelerator.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory_rank{rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)


def dump_out_of_memory(run_dir: Path, accelerator: Accelerator) -> Path:
    """Write what CUDA memory held when it ran out (before the error is raised again)."""
    path = run_dir / f"oom_rank{accelerator.process_index}.txt"
    path.write_text(torch.cuda.memory_summary(accelerator.device))
    with contextlib.suppress(Exception):  # a snapshot exists only while history was being recorded
        torch.cuda.memory._dump_snapshot(str(path.with_suffix(".pickle")))
    return path
