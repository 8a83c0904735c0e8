"""The EMA of the weights (`ema_decay`): torch's EMA of every step's weights, in fp32, resumed bitwise, sharded
like the model under FSDP, evaluated as `eval_ema/<metric>` when asked and exported to final/ema/.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import set_seed
from safetensors import safe_open
from safetensors.torch import load_file

import accel_trainer as at
from accel_trainer import ConfigError
from accel_trainer.optim.ema import WeightAverage
from conftest import read_metrics, train_and_dump

DECAY = 0.75
EVERY_STEP = dict(max_steps=6, global_batch_size=32, micro_batch_size=16, log_every_steps=1, save_every_steps=1,
                  keep_last=0, ema_decay=DECAY, show_progress_bar=False, report=False)  # fmt: skip


def checkpoint_file(run_dir, step: int, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / name))


def test_the_average_is_torchs_ema_and_swapping_it_in_gives_the_weights_back():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(torch.bfloat16)
    average, expected = WeightAverage(model, 0.9), {k: v.float() for k, v in model.state_dict().items()}
    assert all(t.dtype == torch.float32 for t in average.average.values())  # kept in fp32 for a bf16 model
    assert "1.num_batches_tracked" not in average.average  # an integer: not averaged
    for _ in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter))
        average.update()
        expected = {k: torch.lerp(v, model.state_dict()[k].float(), 0.1) for k, v in expected.items()
                    if k in average.average}  # fmt: skip
    assert all(torch.equal(average.average[k], expected[k]) for k in expected)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with average.swapped_in():
        assert torch.equal(model[0].weight, expected["0.weight"].to(torch.bfloat16))
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)


def test_a_run_keeps_the_ema_of_its_weights_after_every_step(tmp_path):
    at.train("mlp", output_dir=str(tmp_path), **EVERY_STEP)

    set_seed(0)  # the run's initial weights: the average starts there
    average = {k: v.float() for k, v in at.get_recipe("mlp")(None).build_model(at.get_recipe("mlp").Config())
               .state_dict().items()}  # fmt: skip
    for step in range(1, 7):
        weights = checkpoint_file(tmp_path, step, "model.safetensors")
        average = {k: torch.lerp(v, weights[k], 1 - DECAY) for k, v in average.items()}
        saved = checkpoint_file(tmp_path, step, "ema.safetensors")
        assert all(torch.equal(saved[k], average[k]) for k in average)
    exported = load_file(str(tmp_path / "final" / "ema" / "model.safetensors"))
    assert all(torch.equal(exported[k], average[k]) for k in average)
    assert not torch.equal(exported["0.weight"], load_file(str(tmp_path / "final" / "model.safetensors"))["0.weight"])


def test_a_resumed_run_continues_its_ema_bitwise(tmp_path):
    at.train("mlp", output_dir=str(tmp_path / "full"), **EVERY_STEP)
    at.train("mlp", output_dir=str(tmp_path / "resumed"), resume=str(tmp_path / "full/checkpoints/step_00000003"),
             **EVERY_STEP)  # fmt: skip

    full, resumed = (load_file(str(tmp_path / run / "final/ema/model.safetensors")) for run in ("full", "resumed"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def test_evaluate_ema_logs_the_averages_metrics_which_keep_best_can_name(tmp_path):
    at.train("mlp", output_dir=str(tmp_path), max_steps=40, eval_every_steps=20, ema_decay=0.9, evaluate_ema=True,
             keep_best_metric="eval_ema/accuracy", keep_best_mode="max", show_progress_bar=False,
             report=False)  # fmt: skip

    evaluations = [r for r in read_metrics(tmp_path) if "eval/loss" in r]
    assert [r["step"] for r in evaluations] == [0, 20, 40]
    assert all({"eval_ema/loss", "eval_ema/accuracy"} <= set(r) for r in evaluations)
    assert evaluations[0]["eval_ema/loss"] == evaluations[0]["eval/loss"]  # step 0: the average is the weights
    assert evaluations[-1]["eval_ema/loss"] != evaluations[-1]["eval/loss"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"ema_decay": 1.0}, "must be below 1"), ({"evaluate_ema": True}, "set ema_decay"),
     ({"keep_best_metric": "eval_ema/loss", "eval_every_steps": 5}, "set evaluate_ema=true")],
)  # fmt: skip
def test_ema_settings_that_cannot_work_are_one_line_errors(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        at.train("mlp", output_dir=str(tmp_path), max_steps=5, **settings)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["cpu_fsdp", "cpu_ddp"])
def test_on_two_processes_the_ema_follows_the_one_process_run_and_resumes_bitwise(tmp_path, layout):
    overrides = [f"{key}={value}" for key, value in EVERY_STEP.items()]
    train_and_dump(layout, tmp_path / "full", "mlp", *overrides, world_size=2)
    train_and_dump(layout, tmp_path / "resumed", "mlp", *overrides,
                   f"resume={tmp_path / 'full/checkpoints/step_00000003'}", world_size=2)  # fmt: skip
    at.train("mlp", output_dir=str(tmp_path / "one"), **EVERY_STEP)

    full, resumed, one = (load_file(str(tmp_path / run / "final/ema/model.safetensors"))
                          for run in ("full", "resumed", "one"))  # fmt: skip
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert all(torch.allclose(full[k], one[k], rtol=0, atol=1e-6) for k in one)
    if layout == "cpu_fsdp":  # sharded like the model: each process wrote its half of every averaged tensor
        shards = sorted((tmp_path / "full/checkpoints/step_00000006/distributed").glob("*.safetensors"))
        rows = {"ema/0.weight": [], "model/0.weight": []}  # the first layer's 128 rows, per file
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                for key, sizes in rows.items():
                    sizes.append(f.get_slice(key).get_shape()[0])
        assert rows["ema/0.weight"] == rows["model/0.weight"] == [64, 64]
        assert not (tmp_path / "full/checkpoints/step_00000006/ema.safetensors").exists()
