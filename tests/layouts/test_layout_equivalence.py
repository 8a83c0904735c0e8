"""One recipe, one config, every CPU layout: the same training trajectory (fp32, same seed, same global batch).

{1 process, accumulation 4} = {2-process DDP, accumulation 2} = {2-process FSDP, accumulation 2}
= {2 "nodes" x 1 process}: final parameters allclose after 12 optimizer steps, for a per-sample mean loss (the
VAE) and a variable-length token loss (the GPT, whose reference is one big batch: 1 process, no accumulation).
The optimizer takes exactly one step per accumulation window on every layout (AdamW's own count). The naive
token normalisation (mean per micro-batch) fails the same comparison, and activation checkpointing changes
nothing but memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import final_parameters, rank_summary, train_and_dump, trajectory

pytestmark = pytest.mark.multiprocess

STEPS = 12
VAE = [
    "sample_latent=false",
    f"max_steps={STEPS}",
    "global_batch_size=64",
    "micro_batch_size=16",
    "log_every_steps=1",
    "eval_every_steps=0",
    "warmup_steps=3",
]
TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # docs/accelerate-traps.md: not bitwise, summation order differs by layout


def launch_on_layout(layout: str, out, recipe: str, overrides: list[str]) -> list[dict]:
    return train_and_dump(layout, out, recipe, *overrides, world_size=1 if layout == "cpu" else 2)


def vae_run(layout: str, tmp_path) -> tuple[Path, list[dict]]:
    """The VAE run of a layout, which the sharding test reads too."""
    return trajectory(layout, "vae", *VAE, world_size=1 if layout == "cpu" else 2)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def vae_reference():
    return trajectory("cpu", "vae", *VAE, world_size=1)


# 2node_cpu (two "machines" on loopback): bitwise cpu_ddp's weights in tests/processes/test_slurm.py (a real Slurm's
# two nodes, preempted and requeued), one process's in test_cluster_engines.py (Kubernetes pods, the GPT's token loss)
@pytest.mark.parametrize("layout", ["cpu_ddp", "cpu_fsdp"])
def test_vae_trains_to_the_same_parameters_on_every_cpu_layout(layout, vae_reference, tmp_path):
    reference_dir, reference_records = vae_reference
    run_dir, records = vae_run(layout, tmp_path)

    expected, actual = final_parameters(reference_dir), final_parameters(run_dir)
    print(f"vae: max |1 process - {layout}| = {max_difference(expected, actual):.3g}")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    assert [r["lr"] for r in records if "loss" in r] == [r["lr"] for r in reference_records if "loss" in r]
    for rank in (0, 1):
        assert rank_summary(run_dir, rank)["optimizer_steps"] == [STEPS]
    assert rank_summary(reference_dir, 0)["optimizer_steps"] == [STEPS]


def test_cpu_fsdp_really_shards_the_parameters(tmp_path):
    run_dir = vae_run("cpu_fsdp", tmp_path)[0]

    total = sum(t.numel() for t in final_parameters(run_dir).values())
    held = [rank_summary(run_dir, rank)["local_elements"] for rank in (0, 1)]
    assert sum(held) == total
    for elements in held:
        assert abs(elements - total / 2) < 0.05 * total, held


GPT = [f"max_steps={STEPS}", "n_layer=2", "n_head=2", "d_model=32", "block_size=32", "global_batch_size=16",
       "log_every_steps=1", "eval_every_steps=0", "warmup_steps=3", "lr=3e-3"]  # fmt: skip
ONE_BIG_BATCH = "micro_batch_size=16"
# Micro-batches are padded to their own longest sequence, so matmul shapes and fp32 rounding differ from the
# big batch; Adam turns that into ~1e-6 parameter differences after 12 steps. The naive normalisation is off
# by ~1e-2, four orders of magnitude more (measured 1.1e-6 vs 1.07e-2).
GPT_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
ACCUMULATE = "micro_batch_size=4"  # accumulation 4 on 1 process, 2 on 2 processes


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_big_batch")
    launch_on_layout("cpu", out, "gpt", [*GPT, ONE_BIG_BATCH])
    return out


# 2node_cpu's token loss: tests/processes/test_cluster_engines.py (the GPT on two loopback nodes, unaccumulated,
# against one process accumulating two micro-batches).
@pytest.mark.parametrize("layout", ["cpu", "cpu_ddp", "cpu_fsdp"])
def test_token_loss_gradient_equals_one_big_batch_on_every_layout(layout, gpt_reference, tmp_path):
    launch_on_layout(layout, tmp_path, "gpt", [*GPT, ACCUMULATE])

    expected, actual = final_parameters(gpt_reference), final_parameters(tmp_path)
    print(f"gpt: max |one big batch - {layout} with accumulation| = {max_difference(expected, actual):.3g}")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **GPT_TOLERANCE)
    for rank in (0, 1) if layout != "cpu" else (0,):
        assert rank_summary(tmp_path, rank)["optimizer_steps"] == [STEPS]


def test_naive_per_micro_batch_mean_fails_the_same_comparison(gpt_reference, tmp_path):
    launch_on_layout("cpu", tmp_path, "gpt_naive", [*GPT, ACCUMULATE])

    expected, actual = final_parameters(gpt_reference), final_parameters(tmp_path)
    print(f"gpt naive: max |one big batch - accumulated micro-batch means| = {max_difference(expected, actual):.3g}")
    with pytest.raises(AssertionError):
        for name in expected:
            torch.testing.assert_close(actual[name], expected[name], **GPT_TOLERANCE)


@pytest.mark.parametrize("layout", ["cpu_ddp", "cpu_fsdp"])
def test_activation_checkpointing_trains_identically_under_ddp_and_fsdp(layout, gpt_reference, tmp_path):
    launch_on_layout(layout, tmp_path, "gpt", [*GPT, ACCUMULATE, "activation_checkpointing=true"])

    expected, actual = final_parameters(gpt_reference), final_parameters(tmp_path)
    print(f"gpt: max |one big batch - {layout} + activation checkpointing| = {max_difference(expected, actual):.3g}")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **GPT_TOLERANCE)
