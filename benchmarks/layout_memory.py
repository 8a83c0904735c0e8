"""Memory per process of the GPT recipe on each CPU layout, from the runs' own records.

    OMP_NUM_THREADS=1 python benchmarks/layout_memory.py      # part of `make bench`; docs/layouts.md

Each layout trains the default GPT (4 layers, d_model 128, about 0.9M parameters) for 4 steps. The table gives
the parameter elements each process holds (`parameters_held_per_process` in run_info.json: its FSDP or
tensor-parallel shard, or its pipeline stages), the model state that implies in fp32 with AdamW (parameter,
gradient and two moments: 16 bytes an element), and the peak host memory of the largest process
(`host_rss_gb`; on the CPU it is dominated by torch itself, about 0.5 GB, so the shards show in the first two
columns).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from accel_trainer.processes import free_port

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LAYOUTS = ["cpu", "cpu_ddp", "cpu_fsdp", "cpu_tp", "cpu_hsdp", "cpu_fsdp_tp", "cpu_pp", "cpu_pp_fsdp"]
FIXED_SHAPES = {"cpu_pp_fsdp"}  # pipeline x FSDP trains one batch shape: the GPT pads to block_size there
GPT = ["max_steps=4", "global_batch_size=16", "micro_batch_size=4", "log_every_steps=2", "eval_every_steps=0",
       "show_progress_bar=false", "save_every_steps=0"]  # fmt: skip
BYTES_PER_ELEMENT = 16  # fp32 parameter + gradient + AdamW's two moments


def measure(layout: str, scratch: Path) -> dict:
    run_dir = scratch / layout
    shape = ["pad_to_block_size=true"] if layout in FIXED_SHAPES else []
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(REPO / "accelerate_configs" / f"{layout}.yaml"),
               "--main_process_port", str(free_port()), "-m", "accel_trainer", "train", "gpt",
               f"output_dir={run_dir}", *GPT, *shape]  # fmt: skip
    subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True)
    start = json.loads((run_dir / "run_info.json").read_text())["starts"][-1]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    held = start["parameters_held_per_process"]
    return {"layout": layout, "processes": len(held), "mesh": start["layout"]["mesh"] or "-",
            "held": max(held), "rss": max(r["host_rss_gb"] for r in records if "host_rss_gb" in r)}  # fmt: skip


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        rows = [measure(layout, Path(scratch)) for layout in LAYOUTS]
    print("| layout | processes | mesh | parameters held per process | fp32 AdamW state per process | peak host RSS |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        state_mb = row["held"] * BYTES_PER_ELEMENT / 1e6
        print(
            f"| {row['layout']} | {row['processes']} | {row['mesh']} | {row['held']:,} | {state_mb:.1f} MB |"
            f" {row['rss']:.2f} GB |"
        )


if __name__ == "__main__":
    main()
