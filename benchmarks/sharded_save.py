"""Training time a checkpoint blocks on the sharded layouts, synchronous against `async_save=true`.

    OMP_NUM_THREADS=1 python benchmarks/sharded_save.py     # part of `make bench`; docs/benchmarks.md

Each layout (FSDP, tensor parallel, pipeline: 2 CPU processes) trains the GPT recipe at 16 layers x 512 (51M
parameters: 0.6 GB of weights and AdamW state over the two processes, the state of benchmarks/checkpoint_speed.py)
twice, saving every 2 steps up to step 12, once synchronously and once with `async_save=true`. The figures are the
run's own `events.jsonl`: a `checkpoint` event's `seconds` is how long training stopped for the save (waiting for
an earlier write included), and each background write's `checkpoint_written` event says how long it wrote. Target
(issue 25): the blocking part of a background save <= 10% of a synchronous save of the same state, in the steady
state (the median of the later saves). The first background save also allocates the host buffers the later ones
reuse, and makes DCP's gloo group: it is printed beside.
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
LAYOUTS = ["cpu_fsdp", "cpu_tp", "cpu_pp"]
GPT = ["n_layer=16", "d_model=512", "n_head=8", "block_size=64", "global_batch_size=4", "micro_batch_size=2",
       "max_steps=12", "save_every_steps=2", "keep_last=0", "eval_every_steps=0", "log_every_steps=2",
       "show_progress_bar=false", "report=false", "max_source_bytes=200000", "eval_fraction=0.01"]  # fmt: skip
TARGET = 0.10


def saves(layout: str, run_dir: Path, async_save: bool) -> list[dict]:
    """The `checkpoint` and `checkpoint_written` events of one run."""
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(REPO / "accelerate_configs" / f"{layout}.yaml"),
               "--main_process_port", str(free_port()), "-m", "accel_trainer", "train", "gpt",
               f"layout=accelerate_configs/{layout}.yaml", f"output_dir={run_dir}", *GPT,
               f"async_save={str(async_save).lower()}"]  # fmt: skip
    subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"].startswith("checkpoint")]


def seconds(events: list[dict], name: str, field: str) -> list[float]:
    return [e[field] for e in events if e["event"] == name]


def main() -> None:
    print(f"{'layout':<9} {'sync save s':>11} {'async blocked s':>15} {'ratio':>6} {'first save':>10} "
          f"{'write s':>8} {'waited s':>9}  target")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        for layout in LAYOUTS:
            sync = seconds(saves(layout, Path(scratch) / f"{layout}_sync", False), "checkpoint", "seconds")
            background = saves(layout, Path(scratch) / f"{layout}_async", async_save=True)
            blocked = seconds(background, "checkpoint", "seconds")
            sync_s, blocked_s = statistics.median(sync[1:]), statistics.median(blocked[1:])
            written_s = statistics.median(seconds(background, "checkpoint_written", "write_s"))
            waited_s = max(seconds(background, "checkpoint_written", "waited_s")[:-1])  # the last: the run's end
            ratio = blocked_s / sync_s
            verdict = "met" if ratio <= TARGET else "NOT met"
            print(f"{layout:<9} {sync_s:>11.3f} {blocked_s:>15.3f} {ratio:>6.3f} {blocked[0] / sync[0]:>10.3f} "
                  f"{written_s:>8.3f} {waited_s:>9.3f}  <= {TARGET}: {verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
