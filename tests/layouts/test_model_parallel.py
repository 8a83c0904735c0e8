"""Tensor parallelism and 2-D meshes on the CPU: the trajectory of one process, each rank holding its shard.

{1 process} = {TP 2} = {FSDP x TP 2x2} = {HSDP 2x2}, for the variable-length token-loss GPT (sequence parallel,
LM head tied to the vocabulary-split embedding) and a mean-loss MLP (a LayerNorm left to replication), and TP 2
for a transformers Llama split by the plan its config declares (`base_model_tp_plan`): the
gradient norm and the loss of every step agree to 1e-6 (relative), the weights after 10 AdamW steps to 1e-4,
and each process holds the share of the parameters its mesh gives it. Checkpoints of a tensor-parallel run are
sharded, resume bitwise on the same layout and continue on another, and export to the run's own weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    BIN,
    checkpoint,
    clean_env,
    export_checkpoint,
    final_parameters,
    rank_summary,
    read_metrics,
    refusal_on_layout,
    run_command,
    train_and_dump,
    train_records,
    trajectory,
)

pytestmark = pytest.mark.multiprocess

STEPS = 10
COMMON = [f"max_steps={STEPS}", "global_batch_size=16", "micro_batch_size=4", "log_every_steps=1", "warmup_steps=2",
          "save_every_steps=5", "keep_last=0"]  # fmt: skip
RECIPES = {
    "gpt": [
        *COMMON,
        "n_layer=2",
        "d_model=32",
        "n_head=4",
        "block_size=32",
        "max_source_bytes=100000",
        "eval_every_steps=0",
    ],  # fmt: skip
    "mlp_tp": [*COMMON, "eval_every_steps=5"],
    "tiny_llama": [*COMMON, "block_size=32", "max_source_bytes=100000", "eval_every_steps=0"],  # transformers' plan
}
WORLD = {"cpu": 1, "cpu_tp": 2, "cpu_fsdp_tp": 4, "cpu_hsdp": 4}
GRADIENTS = dict(rtol=1e-6, atol=1e-7)
WEIGHTS = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def references():
    """Each recipe on one process: the global batch of 16 as 4 accumulated micro-batches of 4."""
    return {recipe: trajectory("cpu", recipe, *overrides, world_size=1) for recipe, overrides in RECIPES.items()}


@pytest.mark.parametrize(
    ("recipe", "layout"),
    [("gpt", "cpu_tp"), ("mlp_tp", "cpu_tp"), ("gpt", "cpu_fsdp_tp"), ("mlp_tp", "cpu_fsdp_tp"),
     ("gpt", "cpu_hsdp"), ("mlp_tp", "cpu_hsdp"), ("tiny_llama", "cpu_tp")],
)  # fmt: skip
def test_a_mesh_layout_follows_the_one_process_trajectory(recipe, layout, references):
    reference_dir, reference_records = references[recipe]
    run_dir, records = trajectory(layout, recipe, *RECIPES[recipe], world_size=WORLD[layout])

    expected, actual = train_records(reference_records), train_records(records)
    assert [r["step"] for r in actual] == list(range(1, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in actual], dtype=torch.float64),
        torch.tensor([r["grad_norm"] for r in expected], dtype=torch.float64),
        **GRADIENTS,
    )
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in actual], dtype=torch.float64),
        torch.tensor([r["loss"] for r in expected], dtype=torch.float64),
        **GRADIENTS,
    )
    assert [r["items_seen"] for r in actual] == [r["items_seen"] for r in expected]  # TP ranks counted once
    reference, trained = final_parameters(reference_dir), final_parameters(run_dir)
    assert trained.keys() == reference.keys()
    worst = max((trained[k] - reference[k]).abs().max().item() for k in reference)
    print(f"{recipe}: max |1 process - {layout}| after {STEPS} steps = {worst:.3g}")
    for name in reference:
        torch.testing.assert_close(trained[name], reference[name], **WEIGHTS)
    evals = [r for r in records if "eval/loss" in r]
    reference_evals = [r for r in reference_records if "eval/loss" in r]
    assert [r["eval/loss"] for r in evals] == pytest.approx([r["eval/loss"] for r in reference_evals], rel=1e-5)


ROWWISE_BIASES = ("proj.bias", "mlp.2.bias", "3.bias")  # added once after the sum: replicated, not split


@pytest.mark.parametrize("recipe", ["gpt", "mlp_tp"])
def test_each_tensor_parallel_rank_holds_its_half_of_the_split_layers(recipe, references):
    run_dir = trajectory("cpu_tp", recipe, *RECIPES[recipe], world_size=2)[0]
    # final/ holds a tied weight under each name: the GPT's LM head is its token embedding, counted once
    reference = {k: v for k, v in final_parameters(references[recipe][0]).items() if k != "lm_head.weight"}
    whole = sum(t.numel() for name, t in reference.items()
                if ".ln" in f".{name}" or name.startswith("0.") or name.endswith(ROWWISE_BIASES))  # fmt: skip
    split = sum(t.numel() for t in reference.values()) - whole
    local = [rank_summary(run_dir, rank)["local_elements"] for rank in (0, 1)]
    assert sum(local) == split + 2 * whole
    # an even split, but for the GPT's 257-row vocabulary: 129 rows of d_model=32 on one rank, 128 on the other
    assert abs(local[0] - local[1]) == (32 if recipe == "gpt" else 0)


@pytest.fixture(scope="module")
def tp_run():
    """The GPT on 2 tensor-parallel processes (the mesh test's run), checkpointed at steps 5 and 10."""
    return trajectory("cpu_tp", "gpt", *RECIPES["gpt"], world_size=2)[0]


def test_a_tensor_parallel_checkpoint_is_sharded_and_resumes_bitwise_on_its_layout(tp_run, tmp_path):
    folder = checkpoint(tp_run, 5)
    assert (folder / "distributed").is_dir() and not (folder / "model.safetensors").exists()
    train_and_dump("cpu_tp", tmp_path, "gpt", *RECIPES["gpt"], f"resume={folder}", world_size=2)

    resumed, uninterrupted = final_parameters(tmp_path), final_parameters(tp_run)
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)
    losses = {r["step"]: r["loss"] for r in train_records(read_metrics(tmp_path))}
    assert losses == {r["step"]: r["loss"] for r in train_records(read_metrics(tp_run)) if r["step"] > 5}


@pytest.mark.parametrize(("layout", "world_size"), [("cpu", 1), ("cpu_fsdp_tp", 4)])
def test_a_tensor_parallel_checkpoint_continues_on_another_layout(tp_run, layout, world_size, tmp_path):
    train_and_dump(layout, tmp_path, "gpt", *RECIPES["gpt"], f"resume={checkpoint(tp_run, 5)}",
                   world_size=world_size)  # fmt: skip
    resumed, uninterrupted = final_parameters(tmp_path), final_parameters(tp_run)
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], **WEIGHTS)


def test_an_fsdp_checkpoint_continues_under_tensor_parallelism(tp_run, tmp_path):
    fsdp = trajectory("cpu_fsdp", "gpt", *RECIPES["gpt"], world_size=2)[0]
    train_and_dump("cpu_tp", tmp_path / "tp", "gpt", *RECIPES["gpt"], f"resume={checkpoint(fsdp, 5)}",
                   world_size=2)  # fmt: skip
    resumed, uninterrupted = final_parameters(tmp_path / "tp"), final_parameters(tp_run)
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], **WEIGHTS)


def test_export_of_a_tensor_parallel_checkpoint_equals_the_runs_weights(tp_run, tmp_path):
    export_checkpoint(checkpoint(tp_run, STEPS), tmp_path)
    exported, final = load_file(str(tmp_path / "model.safetensors")), final_parameters(tp_run)
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[name], final[name]) for name in final)


def test_heads_tensor_parallelism_cannot_split_are_one_line_in_train_and_estimate(tmp_path):
    uneven = [*RECIPES["gpt"], "n_head=3", "d_model=48"]  # 3 heads over tp_size=2
    refusal = refusal_on_layout("cpu_tp", tmp_path / "train", "gpt", *uneven, world_size=2)
    assert refusal is not None and "splits attention heads over tp_size=2 processes, but GPT has n_head=3" in refusal
    planned = run_command([BIN / "accel-trainer", "estimate", "gpt", "layout=8gpu_fsdp_tp", *uneven], env=clean_env(),
                          check=False)  # fmt: skip
    lines = planned.stderr.strip().splitlines()
    assert (
        planned.returncode == 2 and len(lines) == 1 and "GPT has n_head=3: use head counts divisible by 2" in lines[0]
    )


def test_a_transformers_models_own_head_counts_are_checked():
    transformers = pytest.importorskip("transformers")
    from accel_trainer.errors import ConfigError
    from accel_trainer.parallel.tensor_parallel import check_heads_split

    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                      intermediate_size=16, vocab_size=16)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    check_heads_split(model, 2)
    with pytest.raises(ConfigError, match="LlamaForCausalLM has num_key_value_heads=2: use head counts divisible by 4"):
        check_heads_split(model, 4)
