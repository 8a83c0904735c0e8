"""Train N steps uninterrupted == train k, stop, resume, train to N: identical losses and parameters.

On 1 process (in-process), 2-process DDP and 2-process FSDP (real launches); mid-epoch, at an epoch boundary,
with and without random sampling in the loss (the VAE's reparameterisation noise plays the role of dropout).
The digits make 25 steps of 64 per epoch, so step 13 is mid-epoch and step 25 an epoch boundary. A negative
control shows the test fails when the data position is not restored.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import accel_trainer as at
from accel_trainer.data import loaders
from conftest import (
    RESUME_STEPS,
    SAVE_ALL,
    as_kwargs,
    assert_same_run,
    checkpoint,
    final_parameters,
    losses_by_step,
    read_metrics,
    reset_accelerate_state,
    train_and_dump,
)


@pytest.fixture(scope="module", params=["sampling", "deterministic"])
def one_process_full_run(request, tmp_path_factory):
    overrides = [*SAVE_ALL, f"sample_latent={request.param == 'sampling'}", "report=false"]  # nothing reads the report
    run_dir = tmp_path_factory.mktemp(f"full_{request.param}")
    at.train("vae", output_dir=str(run_dir), show_progress_bar=False, **as_kwargs(overrides))
    reset_accelerate_state()
    return run_dir, overrides


@pytest.mark.parametrize("stop_step", [13, 25], ids=["mid_epoch", "epoch_boundary"])
def test_one_process_resume_is_bitwise_identical(one_process_full_run, stop_step, tmp_path):
    full_dir, overrides = one_process_full_run
    at.train("vae", output_dir=str(tmp_path), resume=str(checkpoint(full_dir, stop_step)), show_progress_bar=False,
             **as_kwargs(overrides))  # fmt: skip

    assert_same_run(full_dir, tmp_path, stop_step)


def test_negative_control_resume_without_the_data_position_differs(one_process_full_run, tmp_path, monkeypatch):
    full_dir, overrides = one_process_full_run
    original = loaders.micro_batches
    monkeypatch.setattr(
        loaders, "micro_batches", lambda *args, **kwargs: original(*args, **{**kwargs, "start_step": 0})
    )

    at.train("vae", output_dir=str(tmp_path), resume=str(checkpoint(full_dir, 13)), show_progress_bar=False,
             **as_kwargs(overrides))  # fmt: skip

    with pytest.raises(AssertionError):
        assert_same_run(full_dir, tmp_path, 13)


def test_resume_auto_continues_a_run_folder_from_its_newest_checkpoint(one_process_full_run, tmp_path):
    full_dir, overrides = one_process_full_run
    run_dir = tmp_path / "run"
    shutil.copytree(full_dir, run_dir)
    for later in range(14, RESUME_STEPS + 1):
        shutil.rmtree(checkpoint(run_dir, later))
    (run_dir / "metrics.jsonl").unlink()
    shutil.rmtree(run_dir / "final")

    at.train("vae", output_dir=str(run_dir), show_progress_bar=False, **as_kwargs(overrides))  # resume=auto

    assert_same_run(full_dir, run_dir, 13)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "async_save"), [("cpu_ddp", "false"), ("cpu_fsdp", "true")])
def test_two_process_resume_is_bitwise_identical_mid_epoch_and_at_an_epoch_boundary(layout, async_save, tmp_path):
    # accumulation 2, sampling noise; the sharded checkpoints are written in the background (dcp.async_save)
    overrides = [*SAVE_ALL, "sample_latent=true", "micro_batch_size=16", f"async_save={async_save}"]
    train_and_dump(layout, tmp_path / "full", "vae", *overrides, world_size=2)
    for stop_step in (13, 25):
        resumed = tmp_path / f"resumed_{stop_step}"
        train_and_dump(layout, resumed, "vae", *overrides, f"resume={checkpoint(tmp_path / 'full', stop_step)}",
                       world_size=2)  # fmt: skip
        assert_same_run(tmp_path / "full", resumed, stop_step)


def test_resuming_with_changed_config_keys_lists_them_in_a_warning(one_process_full_run, tmp_path):
    full_dir, overrides = one_process_full_run
    changed = {**as_kwargs(overrides), "lr": "0.01", "weight_decay": "0.1"}

    with pytest.warns(UserWarning, match=r"changed since the checkpoint: lr 0.002 -> 0.01, weight_decay 0.0 -> 0.1$"):
        at.train("vae", output_dir=str(tmp_path), resume=str(checkpoint(full_dir, 13)), show_progress_bar=False,
                 **changed)  # fmt: skip


def test_retention_keeps_the_last_checkpoints_and_the_best_by_an_eval_metric(tmp_path):
    at.train("vae", max_steps=12, save_every_steps=2, eval_every_steps=2, keep_last=2, keep_best_metric="eval/loss",
             keep_best_mode="max", log_every_steps=0, output_dir=str(tmp_path), show_progress_bar=False,
             report=False)  # fmt: skip

    evals = {r["step"]: r["eval/loss"] for r in read_metrics(tmp_path) if "eval/loss" in r and r["step"] > 0}
    worst_step = max(evals, key=evals.get)  # keep_best_mode=max keeps the highest loss: an early step
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert kept == sorted({f"step_{s:08d}" for s in (10, 12, worst_step)})
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000012"


def test_a_signal_during_evaluation_stops_at_that_step_with_a_checkpoint(tmp_path, monkeypatch):
    import os
    import signal

    from accel_trainer.checkpoint import files
    from accel_trainer.stopping.signals import Preempted

    class SignalledDuringSecondEval(at.get_recipe("vae")):
        eval_batches = 0

        def eval_metrics(self, model, batch):
            SignalledDuringSecondEval.eval_batches += 1
            if SignalledDuringSecondEval.eval_batches == 8:  # the sanity check's 1 batch, the step-0 eval's 6 of 32
                os.kill(os.getpid(), signal.SIGUSR1)
            return super().eval_metrics(model, batch)

    monkeypatch.setitem(at.registry._recipes, "vae_signalled", SignalledDuringSecondEval)
    with pytest.raises(Preempted) as stopped:
        at.train("vae_signalled", max_steps=20, eval_every_steps=6, output_dir=str(tmp_path), show_progress_bar=False)

    assert (stopped.value.signal_name, stopped.value.step) == ("SIGUSR1", 6)
    [saved] = files.complete_checkpoints(tmp_path)
    assert files.recorded_step(saved) == 6


def test_async_saves_write_the_same_checkpoints_as_synchronous_saves(tmp_path):
    from safetensors.torch import load_file

    from accel_trainer.checkpoint import files, state_files

    settings = dict(max_steps=12, save_every_steps=4, keep_last=0, log_every_steps=0, eval_every_steps=0,
                    show_progress_bar=False, report=False)  # fmt: skip
    at.train("vae", output_dir=str(tmp_path / "sync"), **settings)
    reset_accelerate_state()
    at.train("vae", output_dir=str(tmp_path / "async"), async_save=True, **settings)

    for step in (4, 8, 12):
        sync, background = checkpoint(tmp_path / "sync", step), checkpoint(tmp_path / "async", step)
        files.verify(background)
        a, b = load_file(str(sync / "model.safetensors")), load_file(str(background / "model.safetensors"))
        assert all(torch.equal(a[name], b[name]) for name in a)
        a, b = state_files.load(sync / "optimizer.safetensors"), state_files.load(background / "optimizer.safetensors")
        assert all(torch.equal(a["state"][k]["exp_avg"], b["state"][k]["exp_avg"]) for k in a["state"])
    sync_final, async_final = final_parameters(tmp_path / "sync"), final_parameters(tmp_path / "async")
    assert all(torch.equal(sync_final[name], async_final[name]) for name in sync_final)
    # events.jsonl says what blocked: a synchronous save blocks for its whole write; a background one is
    # followed by the write's own duration and how long training waited for it
    assert {e["background"] for e in events(tmp_path / "sync", "checkpoint")} == {False}
    assert not events(tmp_path / "sync", "checkpoint_written")
    assert {e["background"] for e in events(tmp_path / "async", "checkpoint")} == {True}
    written = events(tmp_path / "async", "checkpoint_written")
    assert [e["step"] for e in written] == [4, 8, 12]
    assert all(e["write_s"] > 0 and e["waited_s"] >= 0 and e["written_at"] <= e["time"] for e in written)


def events(run_dir, name: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["event"] == name]


@pytest.mark.multiprocess
def test_async_saves_on_two_processes_publish_verified_checkpoints_and_resume(tmp_path):
    from accel_trainer.checkpoint import files

    run = ["max_steps=10", "save_every_steps=3", "keep_last=2", "async_save=true", "log_every_steps=1",
           "eval_every_steps=0", "sample_latent=false"]  # fmt: skip
    train_and_dump("cpu_ddp", tmp_path, "vae", *run, world_size=2)

    kept = files.complete_checkpoints(tmp_path)
    assert [files.recorded_step(p) for p in kept] == [9, 10]
    for folder in kept:
        files.verify(folder)
    records = train_and_dump("cpu_ddp", tmp_path, "vae", *run, "max_steps=12", world_size=2)  # resume=auto
    assert [r["step"] for r in records if "loss" in r][-2:] == [11, 12]


CONSTANT = dict(sample_latent="true", lr_schedule="constant", warmup_steps="0", log_every_steps="1",
                show_progress_bar=False)  # fmt: skip


def test_how_often_a_run_evaluates_leaves_its_training_trajectory_unchanged(tmp_path):
    """An evaluation draws random numbers (its loader's seed); the VAE samples its latent in every training step."""
    at.train("vae", output_dir=str(tmp_path / "often"), max_steps=12, eval_every_steps=3, **CONSTANT)
    at.train("vae", output_dir=str(tmp_path / "once"), max_steps=12, eval_every_steps=0, **CONSTANT)
    assert losses_by_step(tmp_path / "often") == losses_by_step(tmp_path / "once")


def test_a_run_extended_past_its_end_continues_as_the_uninterrupted_run(tmp_path):
    """The first run evaluated at its end (step 7), which the uninterrupted run did not."""
    at.train("vae", output_dir=str(tmp_path / "full"), max_steps=12, eval_every_steps=6, **CONSTANT)
    at.train("vae", output_dir=str(tmp_path / "extended"), max_steps=7, eval_every_steps=6, **CONSTANT)
    with pytest.warns(UserWarning, match="max_steps 7 -> 12"):
        at.train("vae", output_dir=str(tmp_path / "extended"), max_steps=12, eval_every_steps=6, **CONSTANT)
    assert {step: loss for step, loss in losses_by_step(tmp_path / "extended").items() if step > 7} == {
        step: loss for step, loss in losses_by_step(tmp_path / "full").items() if step > 7}  # fmt: skip
