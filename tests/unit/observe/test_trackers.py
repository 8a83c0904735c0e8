"""Trackers mirror metrics.jsonl through accelerate's tracker classes, and never stop training.

Each tracker is read back through its own reader: TensorBoard's EventAccumulator, MLflow's client, trackio's
SQLite store, W&B's reader of its offline transaction logs (`wandb leet inspect`). A tracker that raises is switched
off with one warning; after a resume every series has each step once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

import accel_trainer as at
from accel_trainer.observe import trackers as trackers_module
from conftest import read_metrics, train_and_dump

QUIET = {"show_progress_bar": False, "report": False}


def tensorboard_scalars(run_dir, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    steps = [(event.step, event.value) for event in events.Scalars(tag)]
    assert len(steps) == len({step for step, _ in steps}), f"a step of {tag} appears twice: {steps}"
    return dict(steps)


def test_tensorboard_holds_what_metrics_jsonl_holds(tmp_path):
    at.train("vae", max_steps=12, log_every_steps=3, eval_every_steps=6, trackers="tensorboard",
             output_dir=str(tmp_path), **QUIET)  # fmt: skip

    records = read_metrics(tmp_path)
    for tag in ("loss", "lr", "items_per_s", "eval/loss"):
        expected = {r["step"]: r[tag] for r in records if tag in r}
        assert tensorboard_scalars(tmp_path, tag) == pytest.approx(expected, rel=1e-6)


def test_after_a_resume_every_tensorboard_step_appears_once(tmp_path):
    run = dict(max_steps=10, log_every_steps=1, save_every_steps=5, keep_last=0, trackers="tensorboard", **QUIET)
    at.train("vae", output_dir=str(tmp_path), **run)
    killed_after_logging(tmp_path, last_checkpoint=5, lost_checkpoint=10)

    at.train("vae", output_dir=str(tmp_path), **run)

    assert sorted(tensorboard_scalars(tmp_path, "loss")) == list(range(1, 11))
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == list(range(1, 11))
    dropped = (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()
    assert len(dropped) == 6  # steps 6-10 and the final evaluation of the first attempt, kept aside


@pytest.mark.parametrize(
    ("trackers", "message"),
    [("tensorbord", "not a tracker accelerate knows"), ("all", "not a tracker accelerate knows"),
     ("wandb", "pip install 'accel-trainer\\[wandb\\]'")],
)  # fmt: skip
def test_an_unknown_or_missing_tracker_is_a_one_line_error_before_any_work(trackers, message, tmp_path, monkeypatch):
    monkeypatch.setattr(trackers_module, "get_available_trackers", lambda: [])  # as without the trackers' packages
    with pytest.raises(at.ConfigError, match=message):
        at.train("vae", max_steps=1, trackers=trackers, output_dir=str(tmp_path), **QUIET)
    assert not (tmp_path / "metrics.jsonl").exists()


class BrokenTracker(GeneralTracker):
    name = "broken_for_tests"
    requires_logging_directory = False
    calls = 0

    def __init__(self, run_name: str, **kwargs):
        super().__init__()

    @property
    def tracker(self):
        return None

    def log(self, values, step=None, **kwargs):
        BrokenTracker.calls += 1
        raise ConnectionError("the tracking server is down")


def test_a_tracker_that_fails_is_switched_off_with_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, BrokenTracker.name, BrokenTracker)
    with pytest.warns(UserWarning, match="tracker broken_for_tests failed .*the tracking server is down") as caught:
        result = at.train("vae", max_steps=6, log_every_steps=2, trackers=f"{BrokenTracker.name},tensorboard",
                          output_dir=str(tmp_path), **QUIET)  # fmt: skip

    assert BrokenTracker.calls == 1 and sum("broken_for_tests" in str(w.message) for w in caught) == 1
    assert "loss" in result.metrics
    assert sorted(tensorboard_scalars(tmp_path, "loss")) == [2, 4, 6]  # the other tracker kept working


def killed_after_logging(run_dir, last_checkpoint: int, lost_checkpoint: int) -> None:
    """As if the run had been killed after logging the steps up to `lost_checkpoint`, before saving it."""
    shutil.rmtree(run_dir / "checkpoints" / f"step_{lost_checkpoint:08d}")
    shutil.rmtree(run_dir / "final")
    (run_dir / "checkpoints" / "latest").write_text(f"step_{last_checkpoint:08d}")


def two_runs_and_a_resume(outputs, tracker: str) -> None:
    """Runs `first` and `second` of the vae with `tracker`, then `first` resumed at step 4 after logging 5-8."""
    run = dict(max_steps=8, log_every_steps=1, eval_every_steps=4, save_every_steps=4, keep_last=0,
               trackers=tracker, **QUIET)  # fmt: skip
    at.train("vae", output_dir=str(outputs / "first"), **run)
    at.train("vae", output_dir=str(outputs / "second"), seed=1, **run)
    killed_after_logging(outputs / "first", last_checkpoint=4, lost_checkpoint=8)
    at.train("vae", output_dir=str(outputs / "first"), **run)


def mlflow_runs(outputs, experiment: str) -> dict[str, dict[str, dict[int, float]]]:
    """Each run of `experiment` in the SQLite store beside the run folders, by name: its metric histories."""
    mlflow = pytest.importorskip("mlflow")
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{outputs / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None, [e.name for e in client.search_experiments()]
    runs = {}
    for run in client.search_runs([found.experiment_id]):
        histories = {key: client.get_metric_history(run.info.run_id, key) for key in run.data.metrics}
        for key, history in histories.items():
            assert len(history) == len({m.step for m in history}), f"a step of {key} appears twice"
        runs[run.info.run_name] = {key: {m.step: m.value for m in history} for key, history in histories.items()}
    return runs


def test_mlflow_keeps_a_recipes_runs_in_one_experiment_each_named_after_its_folder_and_a_resume_adds_no_step(
    tmp_path, monkeypatch
):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    two_runs_and_a_resume(tmp_path, "mlflow")

    runs = mlflow_runs(tmp_path, "vae")
    assert sorted(runs) == ["first", "second"]  # one experiment per recipe, one run per folder
    for name in runs:
        for key in ("loss", "lr", "eval/loss"):
            expected = {r["step"]: r[key] for r in read_metrics(tmp_path / name) if key in r}
            assert runs[name][key] == pytest.approx(expected, rel=1e-6), (name, key)


def test_a_resume_from_another_folders_checkpoint_is_a_run_of_its_own_in_the_tracker(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = dict(max_steps=6, log_every_steps=1, save_every_steps=3, trackers="mlflow", **QUIET)
    at.train("vae", output_dir=str(tmp_path / "base"), **run)
    at.train("vae", output_dir=str(tmp_path / "branch"), resume=str(tmp_path / "base/checkpoints/step_00000003"),
             lr=5e-3, **run)  # fmt: skip

    runs = mlflow_runs(tmp_path, "vae")
    assert sorted(runs) == ["base", "branch"] and sorted(runs["branch"]["loss"]) == [4, 5, 6]
    branch = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "branch") if "loss" in r}
    assert runs["branch"]["loss"] == pytest.approx(branch, rel=1e-6)  # its own values (another lr), not base's


def test_tracker_project_names_the_experiment(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    at.train("vae", output_dir=str(tmp_path / "run"), max_steps=2, trackers="mlflow", tracker_project="digits",
             **QUIET)  # fmt: skip
    assert list(mlflow_runs(tmp_path, "digits")) == ["run"]
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the next run's store is its own outputs', not this one's


@pytest.mark.multiprocess
def test_on_two_processes_only_the_main_one_logs_and_mlflow_and_wandb_hold_metrics_jsonl(tmp_path):
    pytest.importorskip("mlflow")
    mode = importlib.util.find_spec("wandb") and trackers_module._wandb_mode().get("mode", os.environ.get("WANDB_MODE"))
    wandb = mode == "offline"  # never online: a W&B login on this machine would upload the test's run
    trackers = "mlflow,wandb" if wandb else "mlflow"
    records = train_and_dump("cpu_ddp", tmp_path / "ddp", "vae", "max_steps=4", "log_every_steps=1",
                             "eval_every_steps=2", f"trackers={trackers}", world_size=2)  # fmt: skip

    runs = mlflow_runs(tmp_path, "vae")
    assert list(runs) == ["ddp"]  # one run: the other process logged nothing
    for key in ("loss", "eval/loss"):
        assert runs["ddp"][key] == pytest.approx({r["step"]: r[key] for r in records if key in r}, rel=1e-6)
    if wandb:
        [attempt] = wandb_runs(tmp_path / "ddp")  # one W&B run: the other process logged nothing
        assert attempt["history"] == logged(tmp_path / "ddp")


def test_trackio_keeps_a_recipes_runs_in_one_project_and_a_resume_adds_no_step(tmp_path, monkeypatch):
    trackio = pytest.importorskip("trackio")  # its store's folder, read at its import (accelerate's), set here
    for module in (trackio, trackio.utils, trackio.sqlite_storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_project_db_path("vae").parent == tmp_path / "trackio"
    two_runs_and_a_resume(tmp_path, "trackio")

    for name in ("first", "second"):
        logs = SQLiteStorage.get_logs("vae", name)
        for key in ("loss", "lr", "eval/loss"):
            held = [(log["step"], log[key]) for log in logs if key in log]
            assert len(held) == len({step for step, _ in held}), f"a step of {key} appears twice in {name}"
            expected = {r["step"]: r[key] for r in read_metrics(tmp_path / name) if key in r}
            assert dict(held) == pytest.approx(expected, rel=1e-6), (name, key)


@pytest.fixture
def wandb_never_set_up(tmp_path, monkeypatch):
    """W&B as where nobody set it up: no mode, no credentials (~/.netrc may hold a login), a fresh W&B session (it
    reads them once), its logs under tmp_path; the W&B service a test starts ends with it."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, folder in (("NETRC", "netrc"), ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_CACHE_DIR", "wandb_cache")):
        monkeypatch.setenv(name, str(tmp_path / folder))
    wandb.teardown()
    yield
    wandb.teardown()


def wandb_runs(run_dir) -> list[dict]:
    """The offline W&B runs in `run_dir/wandb` (one per attempt), oldest first, read by W&B's own reader of its
    transaction logs: each one's id, project, name, config and history ({step: {key: value}})."""
    attempts = []
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        read = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)], check=True,
                              capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})  # fmt: skip
        records = [json.loads(line) for line in read.stdout.splitlines()]
        [run] = [r["run"] for r in records if r["type"] == "run"]
        config = {k: v for r in records if r["type"] == "config" for k, v in r["config"]["update"].items()}
        rows = [r["history"] for r in records if r["type"] == "history"]
        history = {row["step"].get("num", 0): {k: v for k, v in row["item"].items() if k[0] != "_"} for row in rows}
        assert len(history) == len(rows), f"a step appears twice in {log}"
        config.pop("_wandb", None)
        attempts.append({"id": run["run_id"], "project": run["project"], "name": run["display_name"],
                         "config": config, "history": history})  # fmt: skip
    return attempts


def logged(run_dir) -> dict[int, dict]:
    """The numbers a run sent its trackers, by step: metrics.jsonl's, but for the steps a resume trained again the
    first attempt's (metrics.dropped.jsonl), which a tracker holding them keeps (the loss bitwise, timings not)."""
    dropped_file = run_dir / "metrics.dropped.jsonl"
    dropped = [json.loads(line) for line in dropped_file.read_text().splitlines()] if dropped_file.exists() else []
    again = {r["step"] for r in dropped}
    rows: dict[int, dict] = {}
    for record in [r for r in read_metrics(run_dir) if r["step"] not in again] + dropped:
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        rows.setdefault(record["step"], {}).update(numbers)
    return rows


def test_wandb_offline_keeps_a_recipes_runs_in_one_project_and_a_resume_continues_its_run_adding_no_step(
    tmp_path, wandb_never_set_up, capsys
):
    two_runs_and_a_resume(tmp_path, "wandb")

    for name, attempts in (("first", 2), ("second", 1)):
        runs = wandb_runs(tmp_path / name)
        assert [(r["project"], r["name"]) for r in runs] == [("vae", name)] * attempts
        assert len({r["id"] for r in runs}) == 1  # the resume continued the run
        steps = [step for r in runs for step in r["history"]]
        assert len(steps) == len(set(steps)), f"a step of {name} appears in two attempts"
        assert {step: row for r in runs for step, row in r["history"].items()} == logged(tmp_path / name)
        losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r}
        assert {step: row["loss"] for r in runs for step, row in r["history"].items() if "loss" in row} == losses
        config = yaml.safe_load((tmp_path / name / "config.yaml").read_text())
        assert runs[0]["config"].keys() == config.keys()
        assert {k: v for k, v in runs[0]["config"].items() if not isinstance(config[k], list | dict)} == {
            k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in config.items()
            if not isinstance(v, list | dict)}  # fmt: skip
    out = "".join(capsys.readouterr())
    assert f"tracking with wandb: project vae, run first, offline in {tmp_path / 'first' / 'wandb'}" in out
    assert f"(upload: wandb sync {tmp_path / 'first' / 'wandb' / 'offline-run-*'})" in out
    assert "Network error" not in out and "retry" not in out.lower()


def test_tracker_project_names_the_wandb_project(tmp_path, wandb_never_set_up):
    at.train("vae", output_dir=str(tmp_path / "run"), max_steps=1, trackers="wandb", tracker_project="digits", **QUIET)
    assert [(r["project"], r["name"]) for r in wandb_runs(tmp_path / "run")] == [("digits", "run")]


@pytest.mark.parametrize(
    ("setup", "mode"),
    [({}, {"mode": "offline"}), ({"WANDB_MODE": "online"}, {}), ({"WANDB_MODE": "disabled"}, {}),
     ({"WANDB_API_KEY": "k" * 40}, {}), ({"NETRC": "machine api.wandb.ai login user password " + "k" * 40}, {})],
)  # fmt: skip
def test_wandb_runs_offline_only_where_the_user_set_neither_a_mode_nor_a_login(setup, mode, wandb_never_set_up,
                                                                               tmp_path, monkeypatch):  # fmt: skip
    for name, value in setup.items():
        if name == "NETRC":  # `wandb login`'s file, for the host W&B uploads to
            monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")
            (tmp_path / "netrc").write_text(value)
        else:
            monkeypatch.setenv(name, value)
    assert trackers_module._wandb_mode() == mode
