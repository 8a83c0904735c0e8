"""GPT tokens per second with and without sequence packing and torch.compile, one CPU process (issue 11 (f)).

    OMP_NUM_THREADS=1 python benchmarks/gpt_throughput.py     # part of `make bench`; docs/benchmarks.md

Trains the GPT recipe (4 layers, d_model 128, block_size 128) for 80 steps in each of four ways: padded
batches or packed windows, eager or compiled (regional, inductor). Tokens per second are the log records'
`items_per_s` (trained tokens: padding and paragraph starts excluded) over steps 41-80, after compilation and
its one recompilation for dynamic lengths; `padded_per_token` shows what padding costs. A measurement, no
assertions.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
GPT = ["n_layer=4", "d_model=128", "block_size=128", "max_steps=80", "global_batch_size=16", "micro_batch_size=16",
       "log_every_steps=10", "eval_every_steps=0", "save_every_steps=0", "show_progress_bar=false"]  # fmt: skip
VARIANTS = {
    "padded, eager": [],
    "packed, eager": ["pack_sequences=true"],
    "padded, compiled": ["compile=true"],
    "packed, compiled": ["pack_sequences=true", "compile=true"],
}


def measure(overrides: list[str], run_dir: Path) -> tuple[float, float]:
    subprocess.run([BIN / "accel-trainer", "train", "gpt", f"output_dir={run_dir}", *GPT, *overrides],
                   check=True, capture_output=True)  # fmt: skip
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    late = [r for r in records if "items_per_s" in r and r["step"] > 40]
    return statistics.median(r["items_per_s"] for r in late), statistics.mean(r["padded_per_token"] for r in late)


def main() -> None:
    print("| GPT (4 x 128, block 128), 1 CPU thread | tokens/s | padded per token | vs padded, eager |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        base = None
        for index, (name, overrides) in enumerate(VARIANTS.items()):
            tokens, padding = measure(overrides, Path(scratch) / str(index))
            base = base or tokens
            print(f"| {name} | {tokens:,.0f} | {padding:.3f} | x{tokens / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
