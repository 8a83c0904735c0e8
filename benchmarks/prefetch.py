"""Whether building micro-batches on a background thread (`num_prefetch_batches`) pays, one CPU thread.

    OMP_NUM_THREADS=1 python benchmarks/prefetch.py      # part of `make bench`; about two minutes

accel-trainer trains the benchmark MLP of overhead.py on the per-row data path (`data_cache_gb=0`: rows read
from the `datasets.Dataset` and stacked one micro-batch at a time) with num_prefetch_batches=0 and 2, in
alternating chunks, and reports each one's steps per second of wall time (the thread spends CPU time to save
wall time, so CPU time would hide what it is for). Two cases: the wide MLP, whose 30 ms of matrix work
releases the GIL for the thread to read rows, and the tiny one, whose sub-millisecond step leaves it nothing
to overlap. It asserts nothing.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
from pathlib import Path

import torch
from overhead import COMMON, WORKLOADS, MLPConfig, StepClock, accel_seconds, synthetic_dataset

CASES = [(WORKLOADS[2], 12, 12), (WORKLOADS[0], 200, 8)]  # (workload, timed steps, rounds)


def steps_per_s(workload, timed_steps: int, prefetch: int, run_dir: Path) -> float:
    cfg = MLPConfig(**{**COMMON, **workload.overrides}, max_steps=workload.num_untimed_steps + 1 + timed_steps,
                    data_cache_gb=0, num_prefetch_batches=prefetch)  # fmt: skip
    synthetic_dataset(cfg.num_samples, cfg.num_features)
    start = workload.num_untimed_steps + 1
    clock = StepClock(start_step=start, end_step=start + timed_steps)
    with contextlib.redirect_stdout(io.StringIO()):
        wall, _ = accel_seconds(cfg, clock, False, run_dir)
    return timed_steps / wall


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for workload, timed_steps, rounds in CASES:
            rates: dict[int, list[float]] = {0: [], 2: []}
            for index in range(rounds):
                for prefetch in (0, 2) if index % 2 else (2, 0):
                    rates[prefetch].append(steps_per_s(workload, timed_steps, prefetch, Path(tmp) / str(index)))
            gains = sorted(b / a for a, b in zip(rates[0], rates[2], strict=True))
            print(f"{workload.name.split(',')[0]}, per-row data path, {rounds} rounds of {timed_steps} steps:")
            print(f"  built in the step      {statistics.median(rates[0]):8.1f} steps/s (wall)")
            print(f"  num_prefetch_batches=2 {statistics.median(rates[2]):8.1f} steps/s (wall),"
                  f" x{statistics.median(gains):.3f} (range {gains[0]:.3f}-{gains[-1]:.3f})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
