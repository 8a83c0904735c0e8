"""The VAE recipe trains for real on one process and leaves a complete run folder."""

from __future__ import annotations

import yaml
from PIL import Image
from safetensors.torch import load_file

import accel_trainer as at
from conftest import read_metrics


def test_vae_eval_loss_falls_and_the_run_folder_is_complete(tmp_path):
    result = at.train(
        "vae",
        max_steps=300,
        eval_every_steps=150,
        log_every_steps=50,
        output_dir=str(tmp_path),
        show_progress_bar=False,
        report=False,
    )

    records = read_metrics(tmp_path)
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 150, 300]
    assert evals[-1]["eval/loss"] < 0.7 * evals[0]["eval/loss"]
    assert {"eval/reconstruction", "eval/kl"} <= evals[-1].keys()
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [50, 100, 150, 200, 250, 300]
    assert all(
        {"step", "loss", "lr", "world_size", "grad_norm", "samples_per_s", "step_time_s", "epoch"} <= r.keys()
        for r in train_records
    )
    assert result.run_dir == tmp_path
    assert result.metrics["eval/loss"] == evals[-1]["eval/loss"]

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["max_steps"] == 300 and saved["latent_dim"] == 8
    assert yaml.safe_load((tmp_path / "final" / "config.yaml").read_text()) == saved
    weights = load_file(str(tmp_path / "final" / "model.safetensors"))
    model = at.get_recipe("vae")(at.get_recipe("vae").Config()).build_model(at.get_recipe("vae").Config())
    model.load_state_dict(weights)  # consolidated, unwrapped names
    with Image.open(tmp_path / "reconstructions.png") as picture:
        assert picture.size == (16 * 8 * 4, 2 * 8 * 4)


def test_python_api_rejects_a_bad_override_before_training(tmp_path):
    import pytest

    with pytest.raises(at.ConfigError, match="did you mean 'max_steps'"):
        at.train("vae", max_step=3, output_dir=str(tmp_path))
    assert not any(tmp_path.iterdir())
