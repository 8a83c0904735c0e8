"""Throughput, FLOPs and MFU in every log record, counted right and at no per-step cost.

FLOPs per sample are counted on the meta device and checked against the analytic count of the VAE and GPT
recipes; MFU needs a peak (the table for known GPUs, or peak_tflops); evaluation and checkpoint time stay
out of the throughput window; steps between log steps read nothing back from the device.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

import accel_trainer as at
from accel_trainer.config.train_config import resolve_config
from accel_trainer.data import loaders
from accel_trainer.observe.flops import flops_per_sample, table_peak_tflops
from conftest import read_metrics

QUIET = {"show_progress_bar": False, "report": False}
TINY_GPT = {"n_layer": 1, "d_model": 32, "block_size": 32, "max_source_bytes": 100_000}


def first_micro_batch(name: str, **overrides):
    recipe_cls = at.get_recipe(name)
    cfg = resolve_config(recipe_cls.Config, overrides=overrides)
    recipe = recipe_cls(cfg)
    train_set = loaders.as_torch(recipe.build_datasets(cfg)[0])
    return recipe, cfg, recipe.collate([train_set[i] for i in range(cfg.micro_batch_size)])


def test_vae_flops_per_sample_match_the_analytic_count():
    recipe, cfg, batch = first_micro_batch("vae")
    pixels, hidden, latent = 64, cfg.hidden_dim, cfg.latent_dim
    layers = [(pixels, hidden), (hidden, hidden), (hidden, latent), (hidden, latent), (latent, hidden),
              (hidden, hidden), (hidden, pixels)]  # fmt: skip
    forward = sum(2 * fan_in * fan_out for fan_in, fan_out in layers)
    # backward: gradients of weights and of inputs, except the input gradient of the first layer (pixels)
    analytic = 3 * forward - 2 * pixels * hidden

    counted, source = flops_per_sample(recipe, cfg, batch, num_parameters=0)

    assert source.startswith("counted")
    assert abs(counted - analytic) / analytic < 0.02


def test_gpt_flops_per_sample_match_the_analytic_count():
    recipe, cfg, batch = first_micro_batch("gpt", n_layer=2, d_model=64, block_size=64)
    d, layers, vocab = cfg.d_model, cfg.n_layer, 257
    length = batch["input_ids"].shape[1]
    per_layer = 24 * length * d * d + 4 * length * length * d  # projections and MLP, then QK^T and AV
    analytic = 3 * (layers * per_layer + 2 * length * d * vocab)  # forward + backward (2x)

    counted, _ = flops_per_sample(recipe, cfg, batch, num_parameters=0)

    assert abs(counted - analytic) / analytic < 0.02


def test_a_recipe_can_declare_its_own_flops_per_sample():
    recipe, cfg, batch = first_micro_batch("vae")
    recipe.flops_per_sample = 123.0
    declared = (123.0, "declared by the recipe's flops_per_sample")
    assert flops_per_sample(recipe, cfg, batch, num_parameters=0) == declared


def test_counting_flops_leaves_every_random_stream_where_it_was():
    recipe, cfg, batch = first_micro_batch("vae")
    before = torch.get_rng_state()
    flops_per_sample(recipe, cfg, batch, num_parameters=0)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0),
     ("NVIDIA A100-SXM4-80GB", "tf32", 156.0), ("NVIDIA GeForce GTX 1080", "bf16", None)],
)  # fmt: skip
def test_the_peak_comes_from_the_device_name_and_compute_dtype(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert table_peak_tflops(torch.device("cuda"), dtype) == peak
    assert table_peak_tflops(torch.device("cpu"), dtype) is None


def test_records_carry_throughput_progress_and_mfu_when_a_peak_is_given(tmp_path):
    at.train("gpt", max_steps=4, log_every_steps=2, eval_every_steps=0, global_batch_size=16, micro_batch_size=8,
             peak_tflops=0.5, output_dir=str(tmp_path), **TINY_GPT, **QUIET)  # fmt: skip
    records = [r for r in read_metrics(tmp_path) if "loss" in r]

    for record in records:
        assert record["mfu"] == pytest.approx(record["tflops"] / 0.5)
        assert record["items_per_s"] > record["samples_per_s"]  # a token loss: items are tokens
        assert record["step_time_s_min"] <= record["step_time_s_max"] and 0 <= record["data_wait_frac"] < 1
        assert record["host_rss_gb"] > 0 and record["eta_s"] >= 0
    assert [r["samples_seen"] for r in records] == [2 * 16, 4 * 16]
    assert records[1]["items_seen"] > records[0]["items_seen"] > 2 * 16


def test_without_a_known_peak_there_is_no_mfu_but_the_achieved_tflops(tmp_path):
    at.train("vae", max_steps=2, log_every_steps=1, output_dir=str(tmp_path), **QUIET)
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert all("mfu" not in r and r["tflops"] > 0 for r in records)


def test_evaluation_time_stays_out_of_the_throughput_window(tmp_path, monkeypatch):
    class SlowEval(at.get_recipe("vae")):
        def eval_metrics(self, model, batch):
            time.sleep(0.3)  # six eval batches: about 1.8 s an evaluation, against ~10 ms of 5 training steps
            return super().eval_metrics(model, batch)

    monkeypatch.setitem(at.registry._recipes, "vae_slow_eval", SlowEval)
    at.train("vae_slow_eval", max_steps=15, log_every_steps=5, eval_every_steps=5, output_dir=str(tmp_path), **QUIET)

    records = read_metrics(tmp_path)
    assert all(r["eval/seconds"] > 1.5 for r in records if "eval/loss" in r)
    assert all(r["step_time_s"] < 0.25 for r in records if "loss" in r)  # 1.8 s / 5 steps if it leaked in


def count_reads_by_accel_trainer(monkeypatch) -> list[str]:
    """Record every tensor read back to the host (item, tolist, float, bool) made by accel_trainer's own code.

    torch's AdamW reads its CPU step counters with .item() every step; that is no device synchronisation
    (they live on the host on every device) and not the framework's per-step path, so only reads whose
    caller is a file of accel_trainer/ are recorded.
    """
    package = str(Path(at.__file__).parent)
    reads: list[str] = []
    for method in ("item", "tolist", "__float__", "__bool__"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package):
                reads.append(f"{_method} in {Path(caller).relative_to(package)}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    return reads


def test_steps_between_log_steps_read_nothing_back_from_the_device(tmp_path, monkeypatch):
    """Without the non-finite guard nothing is read back between log steps; with it (the default), one verdict
    per step and nothing else: with fused AdamW it is read a step late, when the device has long finished it, so
    it waits for nothing on a GPU (stopping/nonfinite.py)."""
    reads = count_reads_by_accel_trainer(monkeypatch)

    def reads_of_a_run(steps: int, guard: bool) -> list[str]:
        reads.clear()
        at.train("gpt", max_steps=steps, log_every_steps=0, max_grad_norm=1.0, eval_every_steps=0,
                 skip_nonfinite_steps=guard, output_dir=str(tmp_path / f"{steps}{guard}"),
                 **TINY_GPT, **QUIET)  # fmt: skip
        return sorted(reads)

    three = reads_of_a_run(3, guard=False)
    assert three  # the counting sees the reads of the last step's log record and the final evaluation
    assert reads_of_a_run(8, guard=False) == three  # five more steps, not one more read
    guarded = reads_of_a_run(8, guard=True)
    assert sorted(set(guarded) - set(three)) == ["item in stopping/nonfinite.py"]
    assert guarded.count("item in stopping/nonfinite.py") == 8
