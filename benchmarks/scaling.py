"""Scaling on the CPU: the same compute-bound recipe on 1 and on 2 processes, items/s from the runs' own metrics.

    OMP_NUM_THREADS=1 python benchmarks/scaling.py        # part of `make bench`

The GPT recipe at a fixed global batch (accumulation 2 on 1 process, 1 on 2), one thread per process, so 2
processes use 2 cores. Throughput is the mean `items_per_s` (tokens/s) of the log records after the first
(which holds start-up); efficiency = throughput(2) / (2 x throughput(1)). The seeds expect 1.8-1.9x on 2
devices. The script also measures this machine's own ceiling (two single-threaded matmul processes against
one), since 2 vCPUs of a shared host do not give 2x even without any communication.

One pair of runs on this VM gives anything from 1.6x to 1.9x (the 10-step windows of one 2-process run span
100-146 ms a step), so the 1- and 2-process runs alternate for ROUNDS rounds and the median speedup over
rounds is the figure, with its range beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from accel_trainer.processes import free_port

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GPT = ["n_layer=2", "d_model=128", "block_size=128", "global_batch_size=32", "micro_batch_size=16", "max_steps=40",
       "log_every_steps=10", "eval_every_steps=0", "show_progress_bar=false"]  # fmt: skip


def tokens_per_s(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["items_per_s"] for r in records if "items_per_s" in r][1:]
    return sum(speeds) / len(speeds)


MATMUL = """
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
for _ in range(3):
    a @ b
started = time.perf_counter()
for _ in range(60):
    a @ b
print(2 * 1024**3 * 60 / (time.perf_counter() - started) / 1e9)
"""


def matmul_ceiling(env: dict[str, str]) -> float:
    """How much faster two single-threaded matmul processes run together than one (median of 3 trials)."""
    return sorted(_matmul_pair_speedup(env) for _ in range(3))[1]


def _matmul_pair_speedup(env: dict[str, str]) -> float:
    alone = float(subprocess.run([sys.executable, "-c", MATMUL], env=env, capture_output=True, text=True).stdout)
    pair = [subprocess.Popen([sys.executable, "-c", MATMUL], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    together = sum(float(process.communicate()[0]) for process in pair)
    return together / alone


ROUNDS = 3


def one_round(env: dict[str, str], scratch: Path) -> tuple[float, float]:
    """Tokens/s of one 1-process run and one 2-process run, one after the other."""
    one, two = scratch / "one", scratch / "two"
    subprocess.run([BIN / "accel-trainer", "train", "gpt", *GPT, f"output_dir={one}"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    subprocess.run([BIN / "accelerate", "launch", "--config_file", REPO / "accelerate_configs" / "cpu_ddp.yaml",
                    "--main_process_port", str(free_port()), "-m", "accel_trainer", "train", "gpt", *GPT,
                    f"output_dir={two}"], env=env, check=True, capture_output=True)  # fmt: skip
    return tokens_per_s(one), tokens_per_s(two)


def main() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rounds = []
    for index in range(ROUNDS):
        with tempfile.TemporaryDirectory() as scratch:
            rounds.append(one_round(env, Path(scratch)))
        print(
            f"  round {index + 1}: 1 process {rounds[-1][0]:.0f} tokens/s, 2 processes {rounds[-1][1]:.0f}", flush=True
        )
    speedups = sorted(double / single for single, double in rounds)
    speedup = statistics.median(speedups)
    single, double = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
    ceiling = matmul_ceiling(env)
    print(f"scaling (GPT, 2 layers, d=128, T=128, global batch 32, 1 thread per process), {ROUNDS} rounds:")
    print(f"  1 process:    {single:8.0f} tokens/s (median)")
    print(f"  2 processes:  {double:8.0f} tokens/s (median)")
    print(
        f"  speedup x{speedup:.2f} (median of rounds; range {speedups[0]:.2f}-{speedups[-1]:.2f}),"
        f" efficiency {speedup / 2:.2f}; target 1.8x: {'met' if speedup >= 1.8 else 'NOT met'}"
    )
    print(f"  this machine's own ceiling: 2 single-threaded matmul processes run {ceiling:.2f}x one, so the")
    print(f"  2-process run reaches {speedup / ceiling:.2f} of what 2 cores here can give")


if __name__ == "__main__":
    main()
