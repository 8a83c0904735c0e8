"""`accel-trainer estimate` on every shipped layout: a GPT-2-small-sized GPT planned on this CPU, per process.

    OMP_NUM_THREADS=1 python benchmarks/estimate_layouts.py      # part of `make bench`; docs/layouts.md

The byte-level GPT at GPT-2 small's size (12 layers, d_model 768, 12 heads, 1024-token windows: 86M parameters
with its 257-token vocabulary), micro-batches of 4 windows. For each layout: the processes, the largest
process's parameters, gradients, AdamW state and peak in GB (fake tensors: nothing is allocated), whether it
fits an 80 GB GPU, and how long the plan took on this 2-core CPU. The context-parallel layout is refused (one
line): torch's ring attention has no CPU kernel to fake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GPT2_SMALL = ["n_layer=12", "d_model=768", "n_head=12", "block_size=1024", "pad_to_block_size=true",
              "micro_batch_size=4", "global_batch_size=64"]  # fmt: skip
GB = 1e9


def plan(layout: str) -> dict:
    started = time.perf_counter()
    result = subprocess.run(
        [str(BIN / "accel-trainer"), "estimate", "gpt", f"layout={layout}", *GPT2_SMALL, "--json"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        return {"layout": layout, "refused": result.stderr.strip().splitlines()[-1], "seconds": seconds}
    planned = json.loads(result.stdout)
    worst = max(planned["per_rank"], key=lambda memory: memory["peak_bytes"])
    return {"layout": layout, "processes": planned["world_size"], "worst": worst, "seconds": seconds}


def main() -> None:
    layouts = sorted(path.stem for path in (REPO / "accelerate_configs").glob("*.yaml") if ".settings" not in path.name)
    print("| layout | processes | params GB | grads GB | AdamW GB | peak GB (largest process) | fits 80 GB | plan |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in layouts:
        row = plan(layout)
        if "refused" in row:
            print(f"| {layout} | refused: {row['refused'][:90]} | | | | | | {row['seconds']:.0f} s |")
            continue
        worst = row["worst"]
        figures = [worst[key] / GB for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_bytes")]
        fits = "yes" if worst["peak_bytes"] <= 0.9 * 80 * GB else "no"
        print(
            f"| {layout} | {row['processes']} | "
            + " | ".join(f"{figure:.3f}" for figure in figures)
            + f" | {fits} | {row['seconds']:.0f} s |"
        )


if __name__ == "__main__":
    main()
