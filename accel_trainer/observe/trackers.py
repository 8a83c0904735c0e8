"""Experiment trackers (TensorBoard, W&B, MLflow, trackio, ...) mirroring metrics.jsonl, through accelerate.

`trackers=tensorboard,wandb` names any tracker accelerate knows, or one registered with
`accelerate.tracking.register_tracker_class`; accelerate's own tracker classes do the work. They are built on
the main process once the run folder exists. A name accelerate does not know, or one whose package is missing,
is a one-line error at start with the install command.

As their users expect, the runs of one recipe share one project (W&B, trackio) or experiment (MLflow), named
after the recipe or `tracker_project=`, so they can be compared there; each run folder is one tracker run in it,
named after the folder. TensorBoard writes into `<run>/tensorboard` (`tensorboard --logdir outputs` shows every
run by folder). MLflow uses `MLFLOW_TRACKING_URI` where it is set, else a local SQLite store beside the run
folders (`<outputs>/mlflow.db`, artifacts in `<outputs>/mlartifacts`): no server, no network.

W&B writes into `<run>/wandb`. It runs as the user set it up (`WANDB_MODE`, `wandb offline`) or, where W&B has
credentials (`WANDB_API_KEY`, `wandb login`'s ~/.netrc, ...), online; with neither it runs offline rather than
prompting for a login (or failing without a terminal), and `wandb sync <run>/wandb/offline-run-*` uploads it later,
every attempt of a resumed run into one W&B run.

metrics.jsonl stays the source of truth: a tracker that raises is switched off with one warning and never
stops training. On resume the tracker continues its run, each step once: TensorBoard purges the steps after the
resume point (`purge_step`); W&B and MLflow reopen the run whose id the checkpoint saved, trackio the run of the
folder's name, and these three leave out the steps they already hold (a resume is bitwise: they are the values
they have). W&B holds them on its server (online) or in the folder's earlier offline runs of that id, which
`wandb sync` uploads one after the other: each attempt holds only steps after the last one's. A checkpoint of
another folder starts new tracker runs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, get_available_trackers

from accel_trainer.errors import ConfigError

_EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def check_trackers(names: tuple[str, ...]) -> None:
    """Refuse, before any work, a tracker name accelerate does not know or whose package is missing.

    Raises:
        ConfigError: naming the tracker and the fix (a known name, or the install command).
    """
    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            known = ", ".join(sorted(LOGGER_TYPE_TO_CLASS))
            raise ConfigError(
                f"trackers: {name!r} is not a tracker accelerate knows; known: {known} (or register one with"
                " accelerate.tracking.register_tracker_class)"
            )
        builtin = LOGGER_TYPE_TO_CLASS[name].__module__ == "accelerate.tracking"
        if builtin and name not in available:
            extra = f"pip install 'accel-trainer[{_EXTRAS[name]}]'" if name in _EXTRAS else f"pip install {name}"
            raise ConfigError(f"trackers: {name} is not installed: {extra}")


class Trackers:
    """The run's trackers on the main process; every call is a no-op without trackers."""

    def __init__(
        self,
        names: tuple[str, ...],
        run_dir: Path,
        config: dict[str, Any],
        resume_step: int,
        saved_ids: dict,
        project: str = "",
    ) -> None:
        self._trackers: dict[str, GeneralTracker] = {}
        self._held_steps: dict[str, int] = {}  # a reopened MLflow or trackio run's last step: not sent again
        self._sent: dict[str, int] = {}  # each key's last step sent
        for name in names:
            start = functools.partial(self._start, name, run_dir, config, resume_step, saved_ids, project or "runs")
            self._call(name, start)

    def log(self, record: dict[str, Any]) -> None:
        """Send a record's numbers, each key once a step (an evaluation's record repeats the step's samples_seen)."""
        step = record["step"]
        values = {key: value for key, value in record.items() if key != "step" and isinstance(value, int | float)}
        values = {key: value for key, value in values.items() if self._sent.get(key, -1) < step}
        self._sent.update(dict.fromkeys(values, step))
        for name, tracker in list(self._trackers.items()):
            if step > self._held_steps.get(name, -1):
                self._call(name, lambda tracker=tracker: tracker.log(values, step=step))

    def run_ids(self) -> dict[str, str]:
        """The ids of the tracker runs that can be reopened (saved in each checkpoint)."""
        ids = {}
        for name, tracker in self._trackers.items():
            run = getattr(tracker, "run", None) or getattr(tracker, "active_run", None)
            run_id = getattr(run, "id", None) or getattr(getattr(run, "info", None), "run_id", None)
            if isinstance(run_id, str):
                ids[name] = run_id
        return ids

    def finish(self) -> None:
        for name, tracker in list(self._trackers.items()):
            self._call(name, tracker.finish)
        self._trackers.clear()

    def _start(self, name: str, run_dir: Path, config: dict, resume_step: int, saved_ids: dict, project: str) -> None:
        cls = LOGGER_TYPE_TO_CLASS[name]
        kwargs: dict[str, Any] = {}
        held = -1  # the last step a reopened W&B run's earlier offline attempts hold
        if name == "tensorboard":
            project, kwargs = "tensorboard", {"purge_step": resume_step + 1} if resume_step else {}
        elif name == "wandb":
            kwargs = {"name": run_dir.name, "dir": str(run_dir)} | _wandb_mode()
            if name in saved_ids:
                kwargs |= {"id": saved_ids[name], "resume": "allow"}
                held = _last_wandb_offline_step(run_dir / "wandb", saved_ids[name])
        elif name == "mlflow":
            _local_mlflow_store(run_dir.parent)
            kwargs = {"run_name": run_dir.name, "logging_dir": str(run_dir.parent / "mlartifacts")}
            kwargs |= {"run_id": saved_ids[name]} if name in saved_ids else {}
        elif name == "trackio":
            kwargs = {"name": run_dir.name, "resume": "allow"}
        args = (project, str(run_dir)) if cls.requires_logging_directory else (project,)
        tracker = cls(*args, **kwargs)
        tracker.start()
        self._trackers[name] = tracker
        said = f"{'experiment' if name == 'mlflow' else 'project'} {project}, run {run_dir.name}"
        said = {"tensorboard": f"in {run_dir / 'tensorboard'}", "mlflow": f"{said} in {_mlflow_uri()}"}.get(name, said)
        if name == "wandb":
            said += _wandb_where(tracker.run, run_dir)
            said += f"; continuing run {saved_ids[name]}" if name in saved_ids else ""
        print(f"accel-trainer: tracking with {name}: {said}", flush=True)
        if name == "wandb":  # online, W&B's server says where a resumed run is; offline, the folder's files
            self._held_steps[name] = max(held, tracker.run.starting_step - 1)
        elif name == "mlflow" and name in saved_ids:
            self._held_steps[name] = _last_mlflow_step(saved_ids[name])
        elif name == "trackio" and resume_step:  # reopened by its name, the run folder's
            self._held_steps[name] = _last_trackio_step(project, run_dir.name)
        if not resume_step:
            tracker.store_init_configuration(
                {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in config.items()}
            )

    def _call(self, name: str, work: Any) -> None:
        try:
            work()
        except Exception as error:  # noqa: BLE001 - a tracker never stops training
            self._trackers.pop(name, None)
            warnings.warn(
                f"accel-trainer: tracker {name} failed ({type(error).__name__}: {error}) and is off for the"
                " rest of the run; metrics.jsonl has every record",
                stacklevel=2,
            )


def _local_mlflow_store(outputs: Path) -> None:
    """MLflow's store: the user's `MLFLOW_TRACKING_URI`, else a SQLite file beside the run folders (its creation's
    INFO lines, MLflow's and alembic's, kept off the console)."""
    for logger in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(logger).setLevel(logging.WARNING)
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{(outputs / 'mlflow.db').resolve()}")
        os.environ.pop("MLFLOW_TRACKING_URI", None)  # mlflow exports it: a later run here would take it for the user's


def _mlflow_uri() -> str:
    import mlflow

    return str(mlflow.get_tracking_uri())


def _last_mlflow_step(run_id: str) -> int:
    """The last training step a reopened MLflow run holds (every training record logs `loss`)."""
    from mlflow.tracking import MlflowClient

    return max((metric.step for metric in MlflowClient().get_metric_history(run_id, "loss")), default=-1)


def _last_trackio_step(project: str, run: str) -> int:
    """The last step a reopened trackio run holds, from its local SQLite store."""
    from trackio.sqlite_storage import SQLiteStorage

    last = SQLiteStorage.get_max_step_for_run(project, run)
    return -1 if last is None else int(last)


def _wandb_mode() -> dict[str, str]:
    """`mode="offline"` where the user has not set W&B up (no `WANDB_MODE`, no `wandb offline`/`online`, no
    credentials), where `wandb.init` would prompt for a login or, without a terminal, fail; else nothing: the
    user's mode, W&B's credentials."""
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib import wbauth  # what wandb.init's login looks for, without prompting or the network

    settings = wandb_setup.singleton().settings
    if os.environ.get("WANDB_MODE") or settings.mode != "online":
        return {}
    found = wbauth.authenticate_session(
        host=settings.base_url, source="accel-trainer", prompt=False, update_session=False
    )
    return {} if found else {"mode": "offline"}


def _wandb_where(run: Any, run_dir: Path) -> str:
    """Where the W&B run is, for the console line: its page, or its offline folder and how to upload it."""
    if run.disabled:
        return ", disabled (WANDB_MODE): nothing is written"
    if run.offline:
        return f", offline in {run.settings.sync_dir} (upload: wandb sync {run_dir / 'wandb' / 'offline-run-*'})"
    return f" at {run.url}" if run.url else ""


def _last_wandb_offline_step(wandb_dir: Path, run_id: str) -> int:
    """The last step the folder's offline W&B runs of `run_id` (earlier attempts) hold, read by W&B's own reader of
    its transaction logs (`wandb leet inspect --summary --json`, run offline: no network)."""
    last = -1
    for log in sorted(wandb_dir.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb")):
        command = [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(log)]
        read = subprocess.run(command, capture_output=True, text=True, check=True,
                              env={**os.environ, "WANDB_MODE": "offline"})  # fmt: skip
        step = json.loads(read.stdout)["step"]  # None: no step logged
        last = max(last, -1 if step is None else int(step))
    return last
