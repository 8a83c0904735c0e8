"""The libraries' schedules and optimizers by name (`lr_schedule=`, `optimizer=`): transformers' schedules stepped as
ours are (once an optimizer step, checkpointed), torch's AdamW, Adafactor, SGD and Muon with the weight-decay
grouping of the default; Muon with a warmup-stable-decay schedule trains on cpu_ddp to one process's weights and
resumes bitwise (accel_trainer/optim/schedules.py, accel_trainer/contract/optimizers.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import accel_trainer as at
from accel_trainer.config.advice import config_warnings
from accel_trainer.config.train_config import validate_config
from accel_trainer.contract.optimizers import built_in_optimizer
from accel_trainer.optim.schedules import build_scheduler
from conftest import (
    clean_env,
    final_parameters,
    read_metrics,
    refusal_on_layout,
    reset_accelerate_state,
    train_and_dump,
)

transformers = pytest.importorskip("transformers")


def lrs_of(cfg: at.TrainConfig, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    schedule = build_scheduler(optimizer, cfg)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return lrs


def test_warmup_stable_decay_is_transformers_own_with_the_decay_steps_and_floor_given():
    cfg = at.TrainConfig(lr=1.0, max_steps=10, warmup_steps=2, lr_schedule="warmup_stable_decay", decay_steps=3,
                         min_lr_ratio=0.1)  # fmt: skip
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = transformers.get_wsd_schedule(optimizer, num_warmup_steps=2, num_decay_steps=3, num_training_steps=10,
                                           min_lr_ratio=0.1)  # fmt: skip
    expected = []
    for _ in range(10):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        theirs.step()

    lrs = lrs_of(cfg, 10)
    assert lrs == expected
    assert lrs[:2] == [0.1, 0.55] and lrs[2:8] == [1.0] * 6  # warmup from the floor, then stable
    assert 0.1 < lrs[9] < lrs[8] < 1.0  # the decay of the last steps


def test_settings_a_schedule_or_optimizer_has_no_place_for_are_said_and_a_wsd_without_a_stable_phase_is_refused():
    moot = config_warnings(at.TrainConfig(lr_schedule="inverse_sqrt", min_lr_ratio=0.1, decay_steps=5, momentum=0.5))
    assert [problem.split()[0] for problem in moot] == ["min_lr_ratio", "decay_steps", "momentum"]
    assert config_warnings(at.TrainConfig(lr_schedule="cosine_with_min_lr", min_lr_ratio=0.1)) == []
    with pytest.raises(at.ConfigError, match="warmup_steps=8 \\+ decay_steps=3 > max_steps=10"):
        validate_config(at.TrainConfig(lr_schedule="warmup_stable_decay", max_steps=10, warmup_steps=8, decay_steps=3))
    lrs = lrs_of(at.TrainConfig(lr=1.0, max_steps=20, lr_schedule="warmup_stable_decay"), 20)
    assert lrs[:19] == [1.0] * 19 and lrs[19] < 1.0  # the last 2 of 20 steps decay (the first from the peak)


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block, self.norm = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 11, bias=False)

    def get_output_embeddings(self):  # as a transformers model names its output head
        return self.head


@pytest.mark.parametrize("name", ["adamw", "adafactor", "sgd", "muon"])
def test_each_optimizer_decays_matrices_and_embeddings_only_and_muon_takes_the_hidden_linear_weights(name):
    model = TinyLM()
    built = built_in_optimizer(at.TrainConfig(optimizer=name, weight_decay=0.1), model)
    optimizers = built if isinstance(built, dict) else {name: built}

    decay = {id(p): group["weight_decay"] for opt in optimizers.values() for group in opt.param_groups
             for p in group["params"]}  # fmt: skip
    assert sorted(decay) == sorted(id(p) for p in model.parameters())  # each parameter once
    assert decay[id(model.embed.weight)] == decay[id(model.block.weight)] == 0.1
    assert decay[id(model.block.bias)] == decay[id(model.norm.weight)] == 0.0
    expected = {"adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor, "sgd": torch.optim.SGD}
    if name == "muon":
        assert [p for group in built["muon"].param_groups for p in group["params"]] == [model.block.weight]
        assert type(built["adamw"]) is torch.optim.AdamW
    else:
        assert type(built) is expected[name]


def test_muon_on_a_model_without_a_linear_layer_is_one_line_and_takes_transformers_conv1d():
    with pytest.raises(at.ConfigError, match="optimizer=muon: Embedding has no trained weight of a linear layer"):
        built_in_optimizer(at.TrainConfig(optimizer="muon"), torch.nn.Embedding(4, 3))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    muon = built_in_optimizer(at.TrainConfig(optimizer="muon"), gpt2)["muon"]
    assert len([p for group in muon.param_groups for p in group["params"]]) == 4  # c_attn, c_proj, c_fc, mlp c_proj


MUON_WSD = ["optimizer=muon", "lr_schedule=warmup_stable_decay", "warmup_steps=1", "decay_steps=2", "max_steps=6",
            "global_batch_size=8", "micro_batch_size=4", "save_every_steps=3", "log_every_steps=1",
            "eval_every_steps=0", "n_layer=1", "n_head=2", "d_model=32", "block_size=32",
            "max_source_bytes=100000", "lr=0.01"]  # fmt: skip


@pytest.mark.multiprocess
def test_muon_with_warmup_stable_decay_trains_on_ddp_to_one_processs_weights_and_resumes_bitwise(tmp_path):
    alone = train_and_dump("cpu", tmp_path / "alone", "gpt", *MUON_WSD, world_size=1)
    ddp = train_and_dump("cpu_ddp", tmp_path / "ddp", "gpt", *MUON_WSD, world_size=2)

    assert [r["lr/muon"] for r in ddp if "loss" in r] == [r["lr/muon"] for r in alone if "loss" in r]
    for ours, theirs in zip([r for r in ddp if "loss" in r], [r for r in alone if "loss" in r], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
    expected, actual = final_parameters(tmp_path / "alone"), final_parameters(tmp_path / "ddp")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5)

    settings = dict(item.split("=") for item in MUON_WSD)
    at.train("gpt", output_dir=str(tmp_path / "resumed"), resume=str(tmp_path / "alone/checkpoints/step_00000003"),
             show_progress_bar=False, report=False, **settings)  # fmt: skip
    reset_accelerate_state()
    resumed = final_parameters(tmp_path / "resumed")
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    assert [r["lr/adamw"] for r in read_metrics(tmp_path / "resumed") if "loss" in r] == [
        r["lr/adamw"] for r in alone if "loss" in r and r["step"] > 3
    ]


@pytest.mark.multiprocess
def test_muon_on_a_layout_that_shards_the_matrices_is_one_line(tmp_path):
    refusal = refusal_on_layout("cpu_fsdp", tmp_path, "gpt", *MUON_WSD, world_size=2)
    assert refusal is not None and "optimizer=muon orthogonalizes whole matrices" in refusal


def test_estimate_refuses_muon_on_a_sharding_layout_as_the_run_does_in_one_line():
    command = [sys.executable, "-m", "accel_trainer", "estimate", "gpt", "layout=cpu_fsdp", "optimizer=muon"]
    done = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "optimizer=muon orthogonalizes whole matrices" in lines[0]
