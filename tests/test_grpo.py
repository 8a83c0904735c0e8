"""`accel-trainer train grpo`: completions sampled from the current weights, scored by the user's reward functions,
trained on their group advantages (recipes/grpo.py), the same on every layout."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch

import accel_trainer as at
from conftest import final_parameters, read_metrics, reset_accelerate_state, train_and_dump, write_jsonl

REWARDS = """
def has_blue(prompts, completions, colour, **columns):
    return [float(colour_ in completion) for completion, colour_ in zip(completions, colour)]

def length(prompts, completions, number, **columns):
    assert all(type(value) is int for value in number), number  # the columns' Python values, as TRL passes them
    return [-len(completion) / 100 for completion in completions]
"""
COLOURS = ["red", "blue", "green", "amber"]
SMALL = ["max_steps=5", "global_batch_size=4", "micro_batch_size=1", "num_generations=4",
         "max_completion_length=6", "lora_r=4", "lr=1e-2", "log_every_steps=1", "save_every_steps=3"]  # fmt: skip
GENERATIONS = ["steps_per_generation=2", "num_iterations=2"]  # a rollout at steps 1 and 5, each feeding 4 steps


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo_data")
    rows = [{"prompt": f"My favourite colour is {COLOURS[i % 4]} and", "colour": COLOURS[i % 4], "number": i}
            for i in range(16)]  # fmt: skip
    (folder / "rewards.py").write_text(textwrap.dedent(REWARDS))
    return write_jsonl(folder / "prompts.jsonl", rows), folder / "rewards.py"


def grpo(tmp_path, tiny_base, prompts, *overrides):
    data, reward_file = prompts
    settings = dict(item.split("=", 1) for item in [*SMALL, *overrides])
    reset_accelerate_state()
    return at.train("grpo", base=str(tiny_base), data=str(data), rewards=f"{reward_file}:has_blue,{reward_file}:length",
                    output_dir=str(tmp_path), show_progress_bar=False, report=False, **settings)  # fmt: skip


def test_a_grpo_run_logs_its_rewards_and_writes_its_completions(one_process):
    records = [record for record in read_metrics(one_process) if "loss" in record]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5]
    for record in records:
        assert {"reward", "reward_std", "rewards/has_blue", "rewards/length", "completion_length", "entropy",
                "clip_ratio/region"} <= record.keys()  # fmt: skip
        assert 1 <= record["completion_length"] <= 6
        assert -1 <= record["rewards/length"] < 0
        assert 0 < record["entropy"] < math.log(49_152)  # nats, under a uniform choice of the vocabulary

    rows = [json.loads(line) for line in (one_process / "completions.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [step for step in (1, 5) for _ in range(8 * 4)]  # 2 steps' prompts x 4
    first, second = rows[:16], rows[16:32]  # the generation's shares: steps 1 and 3 train on the first, 2 and 4 on
    for step, share in ((1, first), (2, second), (3, first), (4, second)):
        mean_length = sum(row["rewards"]["length"] for row in share) / len(share)
        assert mean_length == pytest.approx(records[step - 1]["rewards/length"], rel=1e-5)  # of these completions
    for group in range(8):  # each group's advantages: rewards less their mean, over their deviation
        advantages = torch.tensor([row["advantage"] for row in rows[group * 4 : group * 4 + 4]])
        assert abs(float(advantages.sum())) < 1e-4
    assert records[0]["clip_ratio/region"] == 0  # the first step trains the sampling weights: the ratio is 1
    assert any(record["clip_ratio/region"] > 0 for record in records[1:4])  # lr 1e-2 moves later steps' ratios


def test_a_rollout_a_step_by_default_samples_each_steps_prompts_with_its_weights(tmp_path, tiny_base, prompts):
    grpo(tmp_path, tiny_base, prompts, "max_steps=2", "steps_per_generation=1", "num_iterations=1", "held_out=0")

    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [step for step in (1, 2) for _ in range(4 * 4)]
    assert all(r["clip_ratio/region"] == 0 for r in read_metrics(tmp_path) if "loss" in r)  # no old weights


def test_answers_of_held_out_prompts_before_and_after_training_are_written(one_process):
    answers = (one_process / "answers.md").read_text()
    assert answers.count("- before: ") == answers.count("- after: ") == 5  # held_out=5 prompts, LoRA's base
    assert "(has_blue " in answers and ", length " in answers  # each answer scored by the reward functions


def test_grpo_resumes_bitwise_inside_a_generation(tmp_path, tiny_base, prompts, one_process):
    inside = one_process / "checkpoints" / "step_00000003"  # step 4 trains on step 1's generation; 5 reads data
    assert (inside / "rollout_rank0.safetensors").is_file()
    resumed = grpo(tmp_path, tiny_base, prompts, *GENERATIONS, f"resume={inside}")

    expected, actual = final_parameters(one_process), final_parameters(tmp_path)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    assert [r["reward"] for r in read_metrics(tmp_path) if "loss" in r] == [
        r["reward"] for r in read_metrics(one_process) if "loss" in r and r["step"] > 3
    ]
    assert resumed is not None


def test_with_dropout_a_resume_inside_a_generation_restores_the_random_streams_at_once(tmp_path, tiny_base, prompts):
    dropout = [*GENERATIONS, "disable_dropout=false", "lora_dropout=0.3", "held_out=0"]  # the adapter's dropout
    grpo(tmp_path / "whole", tiny_base, prompts, *dropout)
    grpo(tmp_path / "resumed", tiny_base, prompts, *dropout, f"resume={tmp_path / 'whole/checkpoints/step_00000003'}")

    expected, actual = final_parameters(tmp_path / "whole"), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


@pytest.fixture(scope="module")
def one_process(tiny_base, prompts, tmp_path_factory):
    return trained_alone(tiny_base, prompts, tmp_path_factory.mktemp("grpo_one_process"))


@pytest.fixture(scope="module")
def full_with_kl_one_process(tiny_base, prompts, tmp_path_factory):
    return trained_alone(tiny_base, prompts, tmp_path_factory.mktemp("grpo_full_kl"), *FULL_WITH_KL)


def trained_alone(tiny_base, prompts, run, *overrides):
    data, reward_file = prompts
    train_and_dump("cpu", run, "grpo", f"base={tiny_base}", f"data={data}", *LAYOUT_RUN, *overrides,
                   f"rewards={reward_file}:has_blue,{reward_file}:length", world_size=1)  # fmt: skip
    return run


LAYOUT_RUN = [*SMALL, *GENERATIONS]
FULL_WITH_KL = ["lora_r=0", "beta=0.04", "lr=1e-3"]  # the reference: a frozen copy, sharded as the policy
LOGGED = ["loss", "reward", "reward_std", "rewards/has_blue", "rewards/length", "completion_length", "entropy"]


def test_a_full_fine_tune_with_kl_keeps_a_frozen_reference_the_policy_moves_away_from(full_with_kl_one_process):
    kl = [record["kl"] for record in read_metrics(full_with_kl_one_process) if "loss" in record]
    assert kl[0] == pytest.approx(0, abs=1e-7) and kl[-1] > 1e-6  # at the reference first, then away from it
    assert not any("reference" in name for name in final_parameters(full_with_kl_one_process))  # the policy alone


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "settings"), [("cpu_ddp", "lora"), ("cpu_fsdp", "lora"), ("cpu_fsdp", "full_with_kl")]
)
def test_grpo_samples_and_trains_as_one_process_does_on_ddp_and_fsdp(layout, settings, tiny_base, prompts, request,
                                                                      tmp_path):  # fmt: skip
    data, reward_file = prompts
    overrides, one_process = ([], request.getfixturevalue("one_process")) if settings == "lora" else (
        FULL_WITH_KL, request.getfixturevalue("full_with_kl_one_process"))  # fmt: skip
    records = train_and_dump(layout, tmp_path, "grpo", f"base={tiny_base}", f"data={data}", *LAYOUT_RUN, *overrides,
                             f"rewards={reward_file}:has_blue,{reward_file}:length", world_size=2)  # fmt: skip

    alone = [record for record in read_metrics(one_process) if "loss" in record]
    mine = [record for record in records if "loss" in record]
    assert len(mine) == len(alone) == 5
    for ours, theirs in zip(mine, alone, strict=True):
        for name in LOGGED + (["kl"] if overrides else []):  # the same completions, so the same rewards and lengths
            assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-6), name
    expected, actual = final_parameters(one_process), final_parameters(tmp_path)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5)

    if layout == "cpu_ddp":
        inside = tmp_path / "checkpoints" / "step_00000003"  # each process's share of a generation, not one's
        with pytest.raises(at.ConfigError, match="inside a rollout's generation .* on 2 process"):
            grpo(tmp_path / "alone", tiny_base, prompts, *GENERATIONS, f"resume={inside}")


def test_a_qlora_run_samples_and_trains_its_adapter_over_a_4_bit_base(tmp_path, tiny_base, prompts, capsys):
    pytest.importorskip("torchao")
    grpo(tmp_path, tiny_base, prompts, "quantize_base=nf4", "max_steps=2", "held_out=0", "save_every_steps=0")

    assert "base: 14 linear weights in 4 bits (NF4)" in capsys.readouterr().out  # 7 linear layers x 2 blocks
    assert [r["step"] for r in read_metrics(tmp_path) if "reward" in r] == [1, 2]
    assert (tmp_path / "final" / "adapter" / "adapter_model.safetensors").is_file()
