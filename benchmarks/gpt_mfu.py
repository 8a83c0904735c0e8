"""Model FLOPs utilisation of a GPT-2 124M-class model on one GPU, trained by the framework (issue 25, item 4).

    python benchmarks/gpt_mfu.py                      # on a CUDA machine; docs/benchmarks.md has the figures
    python benchmarks/gpt_mfu.py --micro_batch_size 16 32 --steps 60

The `gpt` recipe at GPT-2 small's shape (12 layers, 12 heads, d_model 768, 1024-byte context; its vocabulary is
257 bytes, not 50,257 tokens, so about 85M parameters), bf16 autocast, regional torch.compile, the default AdamW
(fused on CUDA), scaled-dot-product attention. The data are nanoGPT's form: contiguous 1024-byte windows of the
corpus with causal attention over the whole window (the recipe's packed mode would restart attention at every
paragraph, which takes SDPA off its flash kernel); `gpt_mfu` below is that recipe. Each variant trains in its
own process through `accel-trainer train ... layout=gpu`; MFU is the framework's own log figure (FLOPs counted
by FlopCounterMode over the device's datasheet peak), the median of the records after compilation. The target
is 0.45 on an H100; nanoGPT reaches about a third to two fifths. A measurement, no assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import accel_trainer as at

ByteGPT = at.get_recipe("gpt")
LAYOUT = "gpu"  # one CUDA GPU (accelerate_configs/gpu.yaml)
GPT2_SMALL = ["n_layer=12", "n_head=12", "d_model=768", "block_size=1024", "pack_sequences=true",
              "eval_every_steps=0", "save_every_steps=0", "show_progress_bar=false", "report=false",
              "mixed_precision=bf16", "compile=true", "warmup_steps=10", "lr=6e-4"]  # fmt: skip


@at.register_recipe("gpt_mfu")
class ContiguousWindowsGPT(ByteGPT):
    """The `gpt` recipe on packed 1025-byte windows read as nanoGPT reads its data: every byte a target,
    positions 0..1023, causal attention across paragraph boundaries (no document mask)."""

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = torch.stack([torch.as_tensor(example["input_ids"], dtype=torch.long) for example in examples])
        positions = torch.arange(ids.shape[1] - 1).repeat(ids.shape[0], 1)  # pinned memory refuses an expand()
        return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "positions": positions}


def measure(micro_batch_size: int, steps: int, extra: list[str], run_dir: Path) -> dict[str, float]:
    """Train one variant in its own process; the medians of its log records after the first third."""
    command = [sys.executable, "-m", "accel_trainer", "train", __file__, f"layout={LAYOUT}",
               f"output_dir={run_dir}", *GPT2_SMALL, f"max_steps={steps}", f"micro_batch_size={micro_batch_size}",
               f"global_batch_size={micro_batch_size}", f"log_every_steps={max(1, steps // 12)}", *extra]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    late = [r for r in records if "mfu" in r and r["step"] > steps // 3]
    keys = ("mfu", "tflops", "items_per_s", "mem_allocated_gb", "data_wait_frac")
    return {key: statistics.median(r.get(key, 0.0) for r in late) for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro_batch_size", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every variant")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpt_mfu: no CUDA GPU here, so nothing measured (not verified on GPU)")
        return
    device = torch.cuda.get_device_name()
    print(f"| GPT-2 small shape, bf16, compiled, {device} | MFU | TFLOP/s | tokens/s | GB | data wait |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for micro_batch_size in args.micro_batch_size:
            try:
                got = measure(micro_batch_size, args.steps, args.extra, Path(scratch) / str(micro_batch_size))
            except subprocess.CalledProcessError as error:
                print(f"| micro-batch {micro_batch_size} x 1024 | failed: {error.stderr.strip()[-300:]} | | | | |")
                continue
            print(f"| micro-batch {micro_batch_size} x 1024 {' '.join(args.extra)} | {got['mfu']:.3f} |"
                  f" {got['tflops']:.0f} | {got['items_per_s']:,.0f} | {got['mem_allocated_gb']:.1f} |"
                  f" {got['data_wait_frac']:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
