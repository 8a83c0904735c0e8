"""BatchNorm: the reported eval metrics are those of the saved model on every layout.

Each process's running statistics drift apart in training (FSDP keeps each process's own; DDP broadcasts
process 0's). They are averaged over the processes before each evaluation and save, so evaluating
final/model.safetensors in one process gives back the logged final metrics. SyncBatchNorm needs CUDA and
is a one-line error on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_model

import accel_trainer as at
from accel_trainer.errors import ConfigError
from conftest import read_metrics, train_and_dump


def evaluate_saved_model(run_dir) -> dict[str, float]:
    from workers.recipes.batchnorm import BatchNormClassifier, BNConfig

    recipe = BatchNormClassifier(BNConfig())
    model = recipe.build_model(recipe.cfg)
    load_model(model, str(run_dir / "final" / "model.safetensors"))
    _, evaluation = recipe.build_datasets(recipe.cfg)
    batch = {key: evaluation[:][key] for key in ("x", "label")}
    with torch.no_grad():
        metrics = recipe.eval_metrics(model.eval(), batch)
    return {f"eval/{name}": values.double().mean().item() for name, values in metrics.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["cpu_ddp", "cpu_fsdp"])
def test_the_logged_eval_metrics_are_the_saved_models(layout, tmp_path):
    train_and_dump(layout, tmp_path, "batchnorm", world_size=2)

    final_eval = [r for r in read_metrics(tmp_path) if "eval/loss" in r][-1]
    saved = evaluate_saved_model(tmp_path)

    assert final_eval["step"] == 12
    assert final_eval["eval/loss"] == pytest.approx(saved["eval/loss"], rel=1e-5)
    assert final_eval["eval/accuracy"] == pytest.approx(saved["eval/accuracy"], abs=1e-9)


def test_sync_batchnorm_on_the_cpu_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="sync_batchnorm=true needs CUDA GPUs"):
        at.train(
            "vae", output_dir=str(tmp_path), sync_batchnorm=True, max_steps=1, show_progress_bar=False, report=False
        )
