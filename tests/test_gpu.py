"""CUDA-only paths: fp16 with its gradient scaler, bf16, FSDP on GPUs. Skipped cleanly without a GPU.

make test PYTEST_ARGS="-m gpu -s"      # on a machine with one or more CUDA GPUs
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    BIN,
    REPO,
    TEST_OVERRIDES,
    WORKERS,
    dump_env,
    final_parameters,
    free_port,
    rank_summary,
    read_metrics,
    run_command,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
QUICK_GPT = ["n_layer=2", "d_model=64", "block_size=64", "log_every_steps=10", "eval_every_steps=0",
             "global_batch_size=32", "micro_batch_size=8"]  # fmt: skip


def launch_on_gpus(layout: str, out, recipe: str, *overrides: str, num_processes: int = 1) -> list[dict]:
    run_command(
        [BIN / "accelerate", "launch", "--config_file", REPO / "accelerate_configs" / f"{layout}.yaml",
         "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
         WORKERS / "train_and_dump.py", recipe, f"output_dir={out}", *overrides, *TEST_OVERRIDES],
        env=dump_env(out, num_processes),
    )  # fmt: skip
    return read_metrics(out)


def test_fp16_skips_overflowing_steps_counts_them_and_does_not_schedule_them(tmp_path):
    # An absurd initial loss scale overflows the first steps; the scaler halves it after each one.
    records = launch_on_gpus("gpu", tmp_path, "vae", "max_steps=40", "log_every_steps=40", "mixed_precision=fp16",
                             "fp16_init_scale=1e30", "fp16_growth_interval=1000")  # fmt: skip

    skipped = records[-1]["skipped_steps"]
    print(f"fp16: {skipped} of 40 steps skipped")
    assert 1 <= skipped < 40
    assert rank_summary(tmp_path, 0)["optimizer_steps"] == [40 - skipped]


def test_bf16_on_cuda_trains_and_reports_its_speed(tmp_path):
    fp32 = launch_on_gpus("gpu", tmp_path / "fp32", "gpt", *QUICK_GPT, "max_steps=60", "mixed_precision=no")
    bf16 = launch_on_gpus("gpu", tmp_path / "bf16", "gpt", *QUICK_GPT, "max_steps=60", "mixed_precision=bf16")

    print(f"bf16 / fp32 samples per second: {bf16[-1]['samples_per_s'] / fp32[-1]['samples_per_s']:.2f}")
    losses = [r["loss"] for r in bf16 if "loss" in r]
    assert losses[-1] < losses[0]


def test_fsdp_on_cuda_shards_and_trains(tmp_path):
    processes = max(n for n in (1, 2, 4) if n <= torch.cuda.device_count())  # divides the global batch of 32
    records = launch_on_gpus("4gpu_fsdp", tmp_path, "gpt", *QUICK_GPT, "max_steps=30", num_processes=processes)

    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]
    total = sum(t.numel() for t in final_parameters(tmp_path).values())
    assert rank_summary(tmp_path, 0)["local_elements"] <= total / processes + 0.05 * total
