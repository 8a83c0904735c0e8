"""Gradient compression (DDP hooks) and mixed precision on the CPU: they train, and ineffective settings warn."""

from __future__ import annotations

import pytest

import accel_trainer as at
from conftest import read_metrics, train_and_dump

QUICK_VAE = ["sample_latent=false", "max_steps=40", "log_every_steps=10", "eval_every_steps=0"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("hook", ["powersgd", "fp16"])
def test_ddp_gradient_compression_hooks_train_on_cpu_gloo(hook, tmp_path):
    records = train_and_dump(
        "cpu_ddp", tmp_path, "vae", *QUICK_VAE, f"ddp_comm_hook={hook}", "ddp_powersgd_rank=2",
        "ddp_powersgd_start_step=2", world_size=2,
    )  # fmt: skip

    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0]


def test_bf16_autocast_trains_on_cpu(tmp_path):
    at.train("vae", max_steps=60, eval_every_steps=60, log_every_steps=20, mixed_precision="bf16",
             output_dir=str(tmp_path), show_progress_bar=False, report=False)  # fmt: skip

    evals = [r["eval/loss"] for r in read_metrics(tmp_path) if "eval/loss" in r]
    assert evals[-1] < 0.8 * evals[0]


def test_fp16_on_cpu_warns_once_that_it_has_no_effect(tmp_path):
    with pytest.warns(UserWarning) as caught:
        at.train(
            "vae", max_steps=1, mixed_precision="fp16", output_dir=str(tmp_path), show_progress_bar=False, report=False
        )

    fp16_warnings = [w for w in caught if "mixed_precision=fp16" in str(w.message)]
    assert len(fp16_warnings) == 1 and "no effect" in str(fp16_warnings[0].message)


def test_ddp_settings_on_a_single_process_warn_that_they_have_no_effect(tmp_path):
    with pytest.warns(UserWarning, match="ddp_comm_hook .*not DDP.* has no effect"):
        at.train(
            "vae",
            max_steps=1,
            ddp_comm_hook="powersgd",
            output_dir=str(tmp_path),
            show_progress_bar=False,
            report=False,
        )


def test_ddp_settings_become_accelerates_ddp_kwargs():
    from accelerate.utils import DDPCommunicationHookType

    from accel_trainer.parallel.accelerator import ddp_kwargs

    cfg = at.LayoutSettings(ddp_find_unused_parameters=True, ddp_static_graph=True, ddp_bucket_cap_mb=4,
                         ddp_gradient_as_bucket_view=True, ddp_comm_hook="powersgd", ddp_powersgd_rank=3,
                         ddp_powersgd_start_step=5)  # fmt: skip
    kwargs = ddp_kwargs(cfg)

    assert (kwargs.find_unused_parameters, kwargs.static_graph, kwargs.bucket_cap_mb) == (True, True, 4)
    assert kwargs.gradient_as_bucket_view is True
    assert kwargs.comm_hook == DDPCommunicationHookType.POWER_SGD
    assert kwargs.comm_state_option == {"matrix_approximation_rank": 3, "start_powerSGD_iter": 5}


def test_powersgd_needs_at_least_two_plain_steps_first():
    from accel_trainer.parallel.accelerator import ddp_kwargs

    with pytest.raises(at.ConfigError, match="ddp_powersgd_start_step=1"):
        ddp_kwargs(at.LayoutSettings(ddp_comm_hook="powersgd", ddp_powersgd_start_step=1))


@pytest.mark.multiprocess
def test_ddp_runs_with_every_tuning_option_set(tmp_path):
    records = train_and_dump(
        "cpu_ddp", tmp_path, "vae", *QUICK_VAE, "ddp_find_unused_parameters=true", "ddp_static_graph=true",
        "ddp_bucket_cap_mb=1", "ddp_gradient_as_bucket_view=true", world_size=2,
    )  # fmt: skip

    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.8 * losses[0]
