"""`accel-trainer estimate`: each process's memory on a layout, planned with fake tensors, is what the layout's real
processes hold (parameters, gradients and optimizer state to the byte, the peak within 20%); its refusals are
one line; `--device_memory_gb` names what would fit."""

import json
import subprocess
import sys

import pytest
import torch
from torch._subclasses import FakeTensorMode

import accel_trainer as at
from tests.conftest import BIN, WORKERS, accelerate_launch, assert_one_line_error, clean_env, run_command

SMALL_GPT = ["n_layer=2", "d_model=64", "micro_batch_size=4", "global_batch_size=8"]
WIDE_GPT = [
    "n_layer=2",
    "d_model=256",
    "micro_batch_size=2",
    "global_batch_size=4",
]  # the model outweighs its activations


def estimate(*words: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_command([BIN / "accel-trainer", "estimate", *words], env=clean_env(), check=check)


def planned_in_this_process(recipe: str, layout: str, words: list[str]) -> dict:
    """What `accel-trainer estimate RECIPE layout=LAYOUT WORDS --json` prints, without starting the command (its
    imports cost a CPU-bound test 5 s)."""
    from accel_trainer.estimate.command import estimate as estimate_ranks
    from accel_trainer.estimate.step_memory import first_examples
    from accel_trainer.parallel.accelerator import settings_on_layout
    from accel_trainer.parallel.layout_file import read_layout

    spec, overrides = read_layout(layout), dict(word.split("=", 1) for word in words)
    recipe_cls = at.get_recipe(recipe)
    cfg, _ = settings_on_layout(recipe_cls.Config, spec, None, overrides)
    ranks = estimate_ranks(recipe, spec, overrides, None, None, first_examples(recipe_cls(cfg), cfg))
    return {"world_size": spec.num_processes, "per_rank": [memory.as_dict() for memory in ranks]}


LOGITS_BYTES = 4 * 64 * 257 * 4  # the small GPT's logits: micro-batch x block x vocabulary, float32


@pytest.mark.multiprocess  # the real side: real processes on a gloo group
@pytest.mark.parametrize(
    ("layout", "model", "peak_within"),
    [
        ("cpu", WIDE_GPT, 0.02),
        ("cpu_ddp", WIDE_GPT, 0.02),
        ("cpu_fsdp", WIDE_GPT, 0.02),
        ("cpu_tp", SMALL_GPT, 0.02),  # and up to two late logits-sized tensors on the real side
        ("cpu_pp", SMALL_GPT, 0.02),
        ("cpu_fsdp_tp", SMALL_GPT, 0.20),
    ],
    ids=["cpu-wide", "cpu_ddp-wide", "cpu_fsdp-wide", "cpu_tp", "cpu_pp", "cpu_fsdp_tp"],
)
def test_the_estimate_of_a_cpu_layout_is_what_its_real_processes_hold(layout, model, peak_within, tmp_path):
    """The real side runs the estimate's own preparation and steps on real tensors and a real gloo group
    (tests/workers/estimate_truth.py). The wide model caught DTensor's shape planning counted as memory (FSDP's
    optimizer step, 4 whole models too many) and DDP's buckets counted twice. The peak is the same to the byte
    where a step frees its tensors in one order; under FSDP x TP a real process sometimes still holds one or two
    more tensors of the full logits' size (4 x 64 x 257 floats) when its peak comes (+5% or +9% on a
    tensor-parallel rank 1 in 5 of 7 runs: when a gloo collective's work lets go of its buffers is timing), hence
    the issue's 20% there. Under TP alone the same two late tensors came in a loaded CI run (+526,336 bytes, two
    logits exactly, on rank 1): the real side may hold them above the 2%."""
    accelerate_launch(layout, WORKERS / "estimate_truth.py", "gpt", str(tmp_path), *model)
    planned = planned_in_this_process("gpt", layout, model)  # the command's figures (its --json: tests below)
    assert planned["world_size"] == len(list(tmp_path.glob("rank*.json")))
    for rank, memory in enumerate(planned["per_rank"]):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert memory["rank"] == rank
        for kind in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert memory[kind] == real[kind], (kind, memory, real)
        late = 2 * LOGITS_BYTES if layout == "cpu_tp" else 0  # held by a real process when its peak comes
        excess = real["tracked_peak_bytes"] - memory["peak_bytes"]
        assert -peak_within * real["tracked_peak_bytes"] <= excess <= peak_within * real["tracked_peak_bytes"] + late
        parts = memory["params_bytes"] + memory["grads_bytes"] + memory["optimizer_bytes"]
        assert memory["activations_bytes"] == memory["peak_bytes"] - parts > 0


def test_a_causal_lm_is_planned_with_its_loss_in_chunks_as_it_runs():
    """hf_causal_lm's default loss holds no logits: its plan is below the logits' plan by at least their float32
    bytes (the fake head once took the logits' path: SmolLM2-135M's sft_chat planned 2,400 MiB where its steps
    held 1,837, docs/memory.md)."""
    words = ["n_layer=1", "d_model=32", "n_head=2", "block_size=32", "micro_batch_size=4", "global_batch_size=4"]
    chunked = planned_in_this_process("hf_causal_lm", "cpu", words)["per_rank"][0]["peak_bytes"]
    logits = planned_in_this_process("hf_causal_lm", "cpu", [*words, "chunked_loss=false"])["per_rank"][0]
    assert logits["peak_bytes"] - chunked >= 4 * 32 * 257 * 4  # micro-batch x block x vocabulary, float32


def test_an_eight_gpu_layout_is_planned_on_this_cpu_with_each_rank_holding_an_eighth():
    whole = planned_in_this_process("gpt", "cpu", SMALL_GPT)["per_rank"][0]
    sharded = planned_in_this_process("gpt", "8gpu_fsdp", ["n_layer=2", "d_model=64", "micro_batch_size=1"])
    assert sharded["world_size"] == 8 and len(sharded["per_rank"]) == 8
    for memory in sharded["per_rank"]:  # fp32 shards (FSDP keeps fp32 master weights under bf16), padded
        assert whole["params_bytes"] / 8 <= memory["params_bytes"] < whole["params_bytes"] / 8 * 1.05


def test_a_layout_whose_sizes_do_not_divide_is_refused_as_the_run_refuses_it():
    result = estimate("gpt", "layout=cpu_hsdp", "global_batch_size=6", "micro_batch_size=1", check=False)
    assert_one_line_error(result.returncode, result.stderr, "global_batch_size=6 is not a multiple")


def test_context_parallelism_holds_each_process_to_its_slice_of_the_sequences():
    """8gpu_fsdp_cp (dp_shard 4 x cp 2) against 8gpu_fsdp at the same micro-batch: the same shards of the model,
    about half the activations (each process its half of every sequence, plus the ring's received slices)."""
    model = ["n_layer=1", "d_model=64", "block_size=256", "pad_to_block_size=true", "micro_batch_size=4"]
    ring = planned_in_this_process("gpt", "8gpu_fsdp_cp", [*model, "global_batch_size=16"])
    whole = planned_in_this_process("gpt", "8gpu_fsdp", [*model, "global_batch_size=32"])
    for sliced, unsliced in zip(ring["per_rank"], whole["per_rank"], strict=True):
        assert sliced["params_bytes"] == unsliced["params_bytes"]  # FSDP shards over dp_shard x cp = 8
        assert 0.4 < sliced["activations_bytes"] / unsliced["activations_bytes"] < 0.7


def test_a_pipeline_over_fsdp_on_eight_gpus_gives_each_stage_its_own_figures():
    words = [*SMALL_GPT[:2], "micro_batch_size=4", "pad_to_block_size=true"]
    planned = planned_in_this_process("gpt", "8gpu_pp_fsdp", words)["per_rank"]
    first_stage, last_stage = planned[:4], planned[4:]
    for stage in (first_stage, last_stage):  # alike, but for FSDP's padding of the last shards
        peaks = [memory["peak_bytes"] for memory in stage]
        assert max(peaks) - min(peaks) < 0.01 * max(peaks)
    assert first_stage[0]["activations_bytes"] > last_stage[0]["activations_bytes"]  # 1F1B: the first holds more


def test_without_a_layout_or_recipe_the_command_says_how_to_write_it():
    result = estimate("gpt", check=False)
    assert_one_line_error(result.returncode, result.stderr, "estimate needs a layout")
    result = estimate("layout=cpu", check=False)
    assert_one_line_error(result.returncode, result.stderr, "estimate needs a recipe")
    result = estimate("grpo", "layout=cpu", check=False)  # its batches are sampled by the model in a rollout
    assert_one_line_error(result.returncode, result.stderr, "estimate grpo: the recipe makes each step's batches")


def test_a_device_too_small_gets_the_setting_that_would_fit():
    result = estimate("gpt", "layout=cpu", *SMALL_GPT, "--device_memory_gb", "0.0075")
    assert "gpt on cpu (1 process(es))" in result.stdout and "does not fit: rank(s) 0" in result.stdout
    assert "fits with " in result.stdout
    assert "fits: every rank" in estimate("gpt", "layout=cpu", *SMALL_GPT, "--device_memory_gb=80").stdout
    answer = json.loads(estimate("gpt", "layout=cpu", *SMALL_GPT, "--device_memory_gb", "0.0075", "--json").stdout)
    assert answer["fits"] is False and answer["device_memory_gb"] == 0.0075 and "fits with" in answer["advice"]


def test_the_advice_halves_the_micro_batch_the_layout_fitted_not_the_recipe_s_default():
    """The GPT's default micro-batch of 16 does not split 24: 12 is estimated, and the advice tries 6, 3, 1."""
    words = ["n_layer=2", "d_model=64", "global_batch_size=24", "--device_memory_gb", "0.0075", "--json"]
    answer = json.loads(estimate("gpt", "layout=cpu", *words).stdout)
    assert answer["per_rank"][0]["micro_batch_size"] == 12
    assert "micro_batch_size=6 " in answer["advice"] and "micro_batch_size=8" not in answer["advice"]


def test_canary_torch_cannot_move_a_module_of_fake_tensors_to_its_own_device():
    """estimate/fake_world.py skips such moves; when this fails, torch moves them and the workaround can go."""
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match="Couldn't swap"):
        torch.nn.Linear(2, 2).to("cpu")


def test_a_recipe_that_reads_a_tensors_value_is_told_in_one_line(tmp_path):
    run_command([BIN / "accel-trainer", "new", "reads_values", "--folder", tmp_path], env=clean_env())
    recipe = tmp_path / "reads_values.py"
    text = recipe.read_text()
    recipe.write_text(
        text.replace(
            "        return nn.functional.cross_entropy(",
            "        assert batch['y'].max().item() >= 0\n        return nn.functional.cross_entropy(",
        )
    )
    result = estimate(str(recipe), "layout=cpu", check=False)
    assert_one_line_error(result.returncode, result.stderr, "reads a tensor's value in its model or compute_loss")


@pytest.mark.parametrize(("words", "said"), [
    (["mlp", "layout=cpu", "--jsn"], "estimate has no option --jsn; did you mean --json?"),
    (["mlp", "layout=cpu", "--device_memory=80"],
     "estimate has no option --device_memory; did you mean --device_memory_gb?"),
    (["mlp"], "estimate needs a layout: accel-trainer estimate mlp layout=8gpu_fsdp ..."),
    (["layout=cpu"], "estimate needs a recipe: accel-trainer estimate NAME layout=LAYOUT [key=value ...]"),
])  # fmt: skip
def test_a_mistake_in_the_command_s_own_words_is_said_before_torch_is_imported(words, said):
    """Reading torch, accelerate and datasets takes about 5 s before the recipe or layout is even looked at."""
    script = (
        "import sys\nfrom accel_trainer import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    print('status', e.code)\n"
        "print('heavy', [m for m in ('torch', 'accelerate', 'datasets') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", script, "estimate", *words], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.stderr.strip().splitlines() == [f"accel-trainer: error: {said}"]
    assert result.stdout.splitlines() == ["status 2", "heavy []"]


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_device_memory_that_is_not_a_positive_number_is_refused(value):
    result = estimate("gpt", "layout=cpu", "--device_memory_gb", value, check=False)
    assert_one_line_error(result.returncode, result.stderr, "--device_memory_gb needs a number of GB above 0")


def test_canary_dtensor_has_no_rule_for_the_cpus_attention():
    """estimate/fake_world.py runs it as the memory-efficient kernel under context parallelism; when this fails,
    torch has a rule (or a CPU ring attention) and the workaround can go."""
    from torch.distributed.tensor import DTensor

    rules = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in rules
