"""The non-finite guard: a step whose loss or gradient norm is NaN or Inf is skipped, counted and changes nothing;
enough of them in a row stop the run with a checkpoint of the last good weights and one line; all processes agree.

The `poisoned` test recipe (tests/workers/recipes) is a BatchNorm classifier whose chosen steps get NaN inputs
(so running statistics, loss and gradients all go NaN) or a NaN loss with finite gradients, on every process or
one. Every step is saved, so a skipped step's checkpoint can be compared with the one before it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import accel_trainer as at
from accel_trainer.checkpoint.export import export
from accel_trainer.stopping.nonfinite import NonfiniteSteps
from conftest import WORKERS, accelerate_launch, assert_bitwise, read_metrics, train_and_dump

SAVE_EVERY_STEP = dict(save_every_steps=1, keep_last=0, show_progress_bar=False)


@pytest.fixture(autouse=True, scope="module")
def poisoned_recipe():
    at.registry.discover_recipes([WORKERS / "recipes"])


def saved(run_dir, step: int, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """A file of the checkpoint of `step`; its weights exported first when they are sharded (FSDP)."""
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    if name == "model.safetensors" and not (folder / name).exists():
        folder = export(folder, run_dir / "exported" / folder.name)
    return load_file(str(folder / name))


def training_records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "lr" in r}


@pytest.mark.parametrize("poison", ["input", "loss"])
def test_a_non_finite_step_is_skipped_counted_and_changes_nothing(tmp_path, poison):
    at.train("poisoned", poison_steps="5", poison=poison, output_dir=str(tmp_path), **SAVE_EVERY_STEP)

    for name in ("model.safetensors", "optimizer.safetensors", "trainer.safetensors"):  # weights, BN stats, Adam,
        assert_bitwise(saved(tmp_path, 4, name), saved(tmp_path, 5, name))  # schedule: as after step 4
    assert not torch.equal(saved(tmp_path, 5)["0.weight"], saved(tmp_path, 6)["0.weight"])  # and it trains on
    records = training_records(tmp_path)
    assert [records[s]["nonfinite_steps"] for s in (4, 5, 10)] == [0, 1, 1]
    assert records[5]["loss"] is None and all(records[s]["loss"] > 0 for s in (4, 6, 10))  # kept out of the mean
    assert records[6]["lr"] == records[5]["lr"]  # the step after the skip gets the skipped step's LR
    assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / "final" / "model.safetensors")).values())
    assert "- steps skipped: 1 nonfinite_steps" in (tmp_path / "report.md").read_text()


def test_without_the_guard_one_nan_step_ruins_the_weights(tmp_path):
    """The negative control: the test above fails when the guard is off."""
    at.train("poisoned", poison_steps="5", skip_nonfinite_steps=False, output_dir=str(tmp_path), **SAVE_EVERY_STEP)

    assert torch.isnan(saved(tmp_path, 5)["0.weight"]).all()
    assert training_records(tmp_path)[10]["nonfinite_steps"] == 0


def test_a_limit_without_the_guard_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="max_nonfinite_in_a_row=3 has no effect with skip_nonfinite_steps=false"):
        at.train("poisoned", skip_nonfinite_steps=False, max_nonfinite_in_a_row=3, max_steps=2,
                 output_dir=str(tmp_path), show_progress_bar=False)  # fmt: skip


def test_too_many_in_a_row_stop_with_a_checkpoint_of_the_last_good_weights(tmp_path):
    with pytest.raises(NonfiniteSteps) as stopped:
        at.train("poisoned", poison_steps="5,6,7", max_nonfinite_in_a_row=3, output_dir=str(tmp_path),
                 log_every_steps=4, **SAVE_EVERY_STEP)  # fmt: skip

    assert "NaN or Inf in steps 5-7 (3 in a row; max_nonfinite_in_a_row=3)" in str(stopped.value)
    assert "step_00000007 holds the weights of step 4" in str(stopped.value)
    assert "rerun the same command to go on past them" in str(stopped.value)
    assert_bitwise(saved(tmp_path, 4), saved(tmp_path, 7))
    assert not (tmp_path / "checkpoints" / "step_00000008").exists()
    assert [r["step"] for r in training_records(tmp_path).values()] == [4, 7]  # the stop records steps 5-7


def test_a_resume_continues_a_cut_streak_and_a_stopped_run_gets_a_new_allowance(tmp_path):
    with pytest.raises(NonfiniteSteps):
        at.train("poisoned", poison_steps="5,6,7", max_nonfinite_in_a_row=3, output_dir=str(tmp_path / "run"),
                 **SAVE_EVERY_STEP)  # fmt: skip
    # Resumed mid-streak (as after a preemption at step 6): the count goes on, one more bad step stops it. The
    # recipe counts its calls from 1 again in a resumed run: its first step, step 7, is poisoned as "1".
    with pytest.raises(NonfiniteSteps, match=r"NaN or Inf in steps 5-7 \(3 in a row"):
        at.train("poisoned", poison_steps="1", max_nonfinite_in_a_row=3, output_dir=str(tmp_path / "cut"),
                 resume=str(tmp_path / "run/checkpoints/step_00000006"), **SAVE_EVERY_STEP)  # fmt: skip
    # Resumed from the stop itself: rerunning is the decision to go on; one bad step is one in a row.
    at.train("poisoned", poison_steps="1", max_nonfinite_in_a_row=3, output_dir=str(tmp_path / "on"),
             resume=str(tmp_path / "run/checkpoints/step_00000007"), **SAVE_EVERY_STEP)  # fmt: skip
    assert training_records(tmp_path / "on")[10]["nonfinite_steps"] == 4


def test_two_skipped_steps_apart_do_not_add_up_to_a_stop(tmp_path):
    at.train("poisoned", poison_steps="3,5,7", max_nonfinite_in_a_row=2, output_dir=str(tmp_path), **SAVE_EVERY_STEP)

    assert training_records(tmp_path)[10]["nonfinite_steps"] == 3


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["cpu_ddp", "cpu_fsdp"])
def test_a_nan_loss_on_one_process_is_skipped_by_every_process(tmp_path, layout):
    """Process 1's loss alone is NaN and every gradient is finite: only an agreement makes process 0 skip too."""
    train_and_dump(layout, tmp_path, "poisoned", "poison_steps=5", "poison=loss", "poison_rank=1",
                   "global_batch_size=16", *[f"{k}={v}" for k, v in SAVE_EVERY_STEP.items()], world_size=2)  # fmt: skip

    assert_bitwise(saved(tmp_path, 4), saved(tmp_path, 5))
    assert training_records(tmp_path)[10]["nonfinite_steps"] == 1


@pytest.mark.multiprocess
def test_the_stop_on_two_processes_is_one_line_per_process(tmp_path):
    result = accelerate_launch("cpu_ddp", WORKERS / "run_recipe.py", "poisoned", "poison_steps=2,3",
                               "max_nonfinite_in_a_row=2", "global_batch_size=16", f"output_dir={tmp_path}",
                               check=False)  # fmt: skip

    errors = [line for line in result.stderr.splitlines() if line.startswith("accel-trainer: error:")]
    assert result.returncode != 0 and len(errors) == 2, result.stderr  # each process exits 2 with its line
    assert all("NaN or Inf in steps 2-3 (2 in a row" in line for line in errors)
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()
