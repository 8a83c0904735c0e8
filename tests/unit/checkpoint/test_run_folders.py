"""Run folders never mix runs and never train silently nothing.

Default folders are unique even for runs started in the same second; `resume=auto` continues only the same
run (another lr is refused, a longer max_steps extends it); a finished run says so and returns its metrics;
`resume=none` never appends to a folder holding a run; re-running a preempted command without `output_dir`
continues it; and metrics.jsonl never holds a step twice after a resume.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import warnings

import pytest

import accel_trainer as at
from accel_trainer.checkpoint import files as checkpoint_files
from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.checkpoint.run_folder import identity
from accel_trainer.errors import UserError
from accel_trainer.optim.schedules import lr_multiplier
from accel_trainer.stopping.signals import Preempted
from conftest import read_metrics

QUICK = dict(max_steps=4, warmup_steps=0, eval_every_steps=0, log_every_steps=1, show_progress_bar=False, report=False)


def logged_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "loss" in r]


def test_six_runs_in_one_second_get_six_folders_that_all_train(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    results = [at.train("vae", lr=lr, max_steps=2, eval_every_steps=0, show_progress_bar=False, report=False)
               for lr in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)]  # fmt: skip

    folders = {result.run_dir for result in results}
    assert len(folders) == 6
    assert all(logged_steps(result.run_dir)[-1] == 2 for result in results)
    assert all(result.metrics["step"] == 2 for result in results)


def test_the_same_folder_with_another_lr_is_refused_naming_the_change(tmp_path):
    at.train("vae", output_dir=str(tmp_path), **QUICK)
    config_before = (tmp_path / "config.yaml").read_text()

    with pytest.raises(CheckpointError, match=r"trained with another config \(lr 0.002 -> 0.01\).*new output_dir"):
        at.train("vae", output_dir=str(tmp_path), **{**QUICK, "lr": 1e-2})

    assert (tmp_path / "config.yaml").read_text() == config_before


def test_a_key_the_checkpoint_does_not_hold_is_a_change_only_away_from_its_default():
    """A field added to the recipe or the framework after the checkpoint was written: at its default, the run
    continues; set to something else, it is another run."""
    from accel_trainer.checkpoint.checks import check_compatible
    from accel_trainer.config.train_config import config_to_dict

    cfg = at.get_recipe("vae").Config()
    written_before_lr_existed = {key: value for key, value in config_to_dict(cfg).items() if key != "lr"}
    state = {"recipe": "vae", "config": written_before_lr_existed, "parameter_shapes": {}}

    check_compatible(state, "vae", cfg, {}, same_run=True)
    with pytest.raises(CheckpointError, match=r"another config \(lr None -> 0.01\)"):
        check_compatible(state, "vae", dataclasses.replace(cfg, lr=0.01), {}, same_run=True)


def test_resuming_from_a_step_that_was_not_saved_names_the_checkpoints_there(tmp_path):
    at.train("vae", output_dir=str(tmp_path / "run"), save_every_steps=2, **QUICK)
    between = checkpoint_files.checkpoints_dir(tmp_path / "run") / "step_00000003"

    with pytest.raises(CheckpointError, match=r"step_00000003: no checkpoint or run folder is there; .* holds"
                       r" step_00000002, step_00000004$"):  # fmt: skip
        at.train("vae", output_dir=str(tmp_path / "resumed"), resume=str(between), **QUICK)


def test_a_finished_run_says_so_and_returns_its_final_metrics(tmp_path, capsys):
    first = at.train("vae", output_dir=str(tmp_path), **QUICK)
    records_before, config_before = read_metrics(tmp_path), (tmp_path / "config.yaml").read_text()
    weights_written = (tmp_path / "final" / "model.safetensors").stat().st_mtime_ns

    again = at.train("vae", output_dir=str(tmp_path), **{**QUICK, "log_every_steps": 2})

    out = capsys.readouterr().out
    assert "already reached step 4 of max_steps=4: nothing to train; its final metrics: step 4 | epoch 1" in out
    assert again.metrics == first.metrics and again.metrics["step"] == 4
    assert read_metrics(tmp_path) == records_before  # and nothing of the finished run is rewritten:
    assert (tmp_path / "config.yaml").read_text() == config_before
    assert (tmp_path / "final" / "model.safetensors").stat().st_mtime_ns == weights_written


def test_a_longer_max_steps_extends_the_run(tmp_path):
    at.train("vae", output_dir=str(tmp_path), **QUICK)

    with pytest.warns(UserWarning, match="max_steps 4 -> 6"):
        result = at.train("vae", output_dir=str(tmp_path), **{**QUICK, "max_steps": 6})

    assert result.metrics["step"] == 6
    assert logged_steps(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_an_extended_run_trains_each_new_step_at_the_new_schedule_s_lr(tmp_path):
    """Step 5 of a cosine run extended from 4 to 6 steps trains at the 6-step schedule's LR for its step, as
    every step after it does (it trained at the 4-step schedule's end, min_lr_ratio x lr, then jumped)."""
    cosine = {**QUICK, "lr_schedule": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.0, "log_every_steps": 1}
    at.train("vae", output_dir=str(tmp_path), **cosine)
    with pytest.warns(UserWarning, match="max_steps 4 -> 6; the LR schedule is stretched to the new max_steps"):
        at.train("vae", output_dir=str(tmp_path), **{**cosine, "max_steps": 6})

    lrs = {record["step"]: record["lr"] for record in read_metrics(tmp_path) if "lr" in record}
    four_steps = dataclasses.replace(at.get_recipe("vae").Config(), **cosine)
    six_steps = dataclasses.replace(four_steps, max_steps=6)
    expected = {step: four_steps.lr * lr_multiplier(step - 1, four_steps) for step in (1, 2, 3, 4)}
    expected |= {step: six_steps.lr * lr_multiplier(step - 1, six_steps) for step in (5, 6)}
    assert lrs == pytest.approx(expected, rel=1e-6) and lrs[5] > 0  # each step's LR as it trained


def test_a_constant_schedule_extended_or_a_finished_run_shortened_is_not_said_to_stretch(tmp_path):
    at.train("vae", output_dir=str(tmp_path), **{**QUICK, "lr_schedule": "constant"})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        at.train("vae", output_dir=str(tmp_path), **{**QUICK, "lr_schedule": "constant", "max_steps": 6})
        at.train("vae", output_dir=str(tmp_path), **{**QUICK, "lr_schedule": "constant", "max_steps": 5})
    changes = [str(warning.message) for warning in said if "config keys changed" in str(warning.message)]
    assert len(changes) == 2 and not any("stretched" in change for change in changes), changes


def test_resume_none_into_a_folder_holding_a_run_is_refused(tmp_path):
    at.train("vae", output_dir=str(tmp_path), **QUICK)

    with pytest.raises(UserError, match="already holds a run and resume=none would mix a second one into it"):
        at.train("vae", output_dir=str(tmp_path), resume="none", **QUICK)


def test_rerunning_a_preempted_command_without_output_dir_continues_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class StoppedOnce(at.get_recipe("vae")):
        calls = 0

        def compute_loss(self, model, batch):
            StoppedOnce.calls += 1
            if StoppedOnce.calls == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
            return super().compute_loss(model, batch)

    monkeypatch.setitem(at.registry._recipes, "vae_stopped_once", StoppedOnce)
    with pytest.raises(Preempted) as stopped:
        at.train("vae_stopped_once", **QUICK)
    result = at.train("vae_stopped_once", **QUICK)

    assert "rerun the same command to continue" in str(stopped.value)
    assert result.run_dir == stopped.value.checkpoint.parent.parent
    assert logged_steps(result.run_dir) == [1, 2, 3, 4]
    assert not list((tmp_path / "outputs" / "vae_stopped_once" / ".preempted").glob("*"))  # the marker is gone


def test_a_setting_a_later_version_adds_at_its_default_leaves_a_stopped_run_s_identity_as_it_was():
    """The marker of a preempted run is found by this identity: an upgrade adding a config field must not lose it."""

    @dataclasses.dataclass
    class Upgraded(at.TrainConfig):
        a_new_setting: int = 7

    assert identity("vae", Upgraded(lr=0.1)) == identity("vae", at.TrainConfig(lr=0.1))
    assert identity("vae", Upgraded(lr=0.1, a_new_setting=8)) != identity("vae", at.TrainConfig(lr=0.1))
    assert identity("vae", at.TrainConfig(lr=0.2)) != identity("vae", at.TrainConfig(lr=0.1))
    assert identity("vae", at.TrainConfig(lr=0.1, show_progress_bar=False)) == identity("vae", at.TrainConfig(lr=0.1))


def test_after_a_resume_metrics_never_hold_a_step_twice(tmp_path):
    at.train("vae", output_dir=str(tmp_path), save_every_steps=2, keep_last=0, **QUICK)
    # A kill after step 4 was logged but before its checkpoint: the run resumes from step 2.
    shutil.rmtree(checkpoint_files.final_folder(tmp_path, 4))

    at.train("vae", output_dir=str(tmp_path), save_every_steps=2, keep_last=0, **QUICK)

    assert logged_steps(tmp_path) == [1, 2, 3, 4]


def test_a_run_that_died_before_its_first_checkpoint_starts_over_with_its_old_records_set_aside(tmp_path):
    at.train("vae", output_dir=str(tmp_path), **QUICK)
    shutil.rmtree(tmp_path / "checkpoints")

    at.train("vae", output_dir=str(tmp_path), **QUICK)

    assert logged_steps(tmp_path) == [1, 2, 3, 4]
    assert (tmp_path / "metrics.abandoned.jsonl").is_file()


def test_two_different_settings_of_mixed_precision_train_one_after_another_in_one_process(tmp_path):
    at.train("vae", output_dir=str(tmp_path / "a"), mixed_precision="no", **QUICK)
    result = at.train("vae", output_dir=str(tmp_path / "b"), mixed_precision="bf16", **QUICK)

    assert result.metrics["step"] == 4


def test_run_folder_files_follow_the_umask_so_a_team_can_share_them(tmp_path):
    result = at.train("vae", output_dir=str(tmp_path), **QUICK)

    umask = os.umask(0)
    os.umask(umask)
    files = [path for path in result.run_dir.rglob("*") if path.is_file()]
    assert {path.stat().st_mode & 0o777 for path in files} == {0o666 & ~umask}  # safetensors alone wrote 0o600


@at.register_recipe("unbuildable")
class Unbuildable(at.Recipe):
    """A recipe whose model cannot be built: the run fails before it writes anything."""

    def build_model(self, cfg):
        raise ValueError("no such layer size")


def test_a_run_that_fails_before_writing_anything_leaves_no_empty_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no such layer size"):
        at.train("unbuildable", **QUICK)
    with pytest.raises(ValueError, match="no such layer size"):
        at.train("unbuildable", output_dir=str(tmp_path / "named"), **QUICK)

    assert not (tmp_path / "outputs").exists()  # not even an empty outputs/unbuildable/
    assert not (tmp_path / "named").exists()


def test_a_folder_that_existed_before_the_failed_run_stays(tmp_path):
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="no such layer size"):
        at.train("unbuildable", output_dir=str(tmp_path / "mine"), **QUICK)
    assert (tmp_path / "mine").is_dir()
