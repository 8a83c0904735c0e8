"""Real 2-process runs on the CPU (gloo): what only distribution can break.

Each launch goes through a real launcher and each worker checks it sees the world size the test expected.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    BIN,
    REPO,
    WORKERS,
    accelerate_launch,
    clean_env,
    free_port,
    rank_parameters,
    read_metrics,
    run_command,
    train_and_dump,
)

pytestmark = pytest.mark.multiprocess

# A deterministic VAE run (posterior mean, no sampling noise) that crosses an epoch boundary: 1617 training
# digits make 25 steps of 64 per epoch.
DETERMINISTIC_VAE = [
    "sample_latent=false",
    "max_steps=30",
    "global_batch_size=64",
    "log_every_steps=1",
    "warmup_steps=5",
    "eval_every_steps=0",
]


def test_two_processes_end_with_identical_parameters_on_the_one_process_trajectory_at_the_same_global_batch(
    tmp_path,
):
    one = train_and_dump("cpu", tmp_path / "one", "vae", *DETERMINISTIC_VAE, "micro_batch_size=16", world_size=1)
    two = train_and_dump("cpu_ddp", tmp_path / "two", "vae", *DETERMINISTIC_VAE, "micro_batch_size=16", world_size=2)

    rank0, rank1 = rank_parameters(tmp_path / "two", 0), rank_parameters(tmp_path / "two", 1)
    assert rank0.keys() == rank1.keys() and all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    assert {r["world_size"] for r in two if "loss" in r} == {2}

    # 1 process accumulates 4 micro-batches of 16, 2 processes 2 each: the same 64 samples per step.
    one_params, two_params = rank_parameters(tmp_path / "one", 0), rank_parameters(tmp_path / "two", 0)
    worst = max((one_params[k] - two_params[k]).abs().max().item() for k in one_params)
    print(f"max |1 process - 2 processes| over parameters after 30 steps: {worst:.3g}")
    for name in one_params:
        torch.testing.assert_close(two_params[name], one_params[name], rtol=1e-5, atol=1e-6)
    one_train = [r for r in one if "loss" in r]
    two_train = [r for r in two if "loss" in r]
    # The LR schedule is stepped once per optimizer step, never once per process (accelerate #2926).
    assert [r["lr"] for r in one_train] == [r["lr"] for r in two_train]
    assert [r["step"] for r in two_train] == list(range(1, 31))
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in two_train]), torch.tensor([r["loss"] for r in one_train]), rtol=1e-5, atol=0
    )


def test_recipe_registered_in_a_standalone_script_trains_under_accelerate_launch(tmp_path):
    accelerate_launch("cpu_ddp", WORKERS / "standalone_recipe.py", f"output_dir={tmp_path}")

    records = read_metrics(tmp_path)
    assert [r["world_size"] for r in records] == [2, 2, 2]
    assert records[-1]["loss"] < 0.1 * records[0]["loss"]
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_cpu_launch_that_would_silently_start_one_process_is_refused(tmp_path):
    result = run_command(
        [
            BIN / "accelerate",
            "launch",
            "--quiet",
            "--cpu",
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
            REPO / "recipes" / "vae.py",
            f"output_dir={tmp_path}",
        ],
        check=False,
    )

    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if "accel-trainer: error:" in line]
    assert len(error_lines) == 1 and "cpu_ddp.yaml" in error_lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_accelerate_alone_on_a_cpu_torchrun_launch_sees_a_world_of_one():
    """The trap launch_fixes.wants_cpu exists for: two workers training independently, no error."""
    result = run_command(
        [
            BIN / "torchrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            WORKERS / "bare_accelerator_world.py",
        ],
        env=clean_env(),
    )
    assert result.stdout.count("world 1 NO") == 2, result.stdout + result.stderr


def test_canary_accelerate_turns_fsdp_on_the_cpu_into_ddp():
    """The trap launch_fixes.enable_fsdp_on_cpu exists for: an FSDP layout on the CPU silently trains as DDP."""
    result = accelerate_launch("cpu_fsdp", WORKERS / "bare_accelerator_world.py", "--cpu", env=clean_env())
    assert result.stdout.count("world 2 MULTI_CPU") == 2, result.stdout + result.stderr
