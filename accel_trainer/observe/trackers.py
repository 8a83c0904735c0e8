"""Experiment trackers (TensorBoard, W&B, MLflow, trackio, ...) mirroring metrics.jsonl, through accelerate.

`trackers=tensorboard,wandb` names any tracker accelerate knows, or one registered with
`accelerate.tracking.register_tracker_class`; accelerate's own tracker classes do the work. They are built on
the main process once the run folder exists; TensorBoard writes into `<run>/tensorboard`. A name accelerate
does not know, or one whose package is missing, is a one-line error at start with the install command.

metrics.jsonl stays the source of truth: a tracker that raises is switched off with one warning and never
stops training. On resume the tracker continues its run: TensorBoard purges the steps after the resume point
(`purge_step`), W&B and MLflow reopen the run whose id the checkpoint saved.
"""

from __future__ import annotations

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
        self, names: tuple[str, ...], run_dir: Path, config: dict[str, Any], resume_step: int, saved_ids: dict
    ) -> None:
        self._trackers: dict[str, GeneralTracker] = {}
        for name in names:
            self._call(name, lambda name=name: self._start(name, run_dir, config, resume_step, saved_ids))

    def log(self, record: dict[str, Any]) -> None:
        values = {key: value for key, value in record.items() if key != "step" and isinstance(value, int | float)}
        for name, tracker in list(self._trackers.items()):
            self._call(name, lambda tracker=tracker: tracker.log(values, step=record["step"]))

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

    def _start(self, name: str, run_dir: Path, config: dict, resume_step: int, saved_ids: dict) -> None:
        cls = LOGGER_TYPE_TO_CLASS[name]
        project = run_dir.name
        kwargs: dict[str, Any] = {}
        if name == "tensorboard":
            project, kwargs = "tensorboard", {"purge_step": resume_step + 1} if resume_step else {}
        elif name == "wandb" and name in saved_ids:
            kwargs = {"id": saved_ids[name], "resume": "allow"}
        elif name == "mlflow" and name in saved_ids:
            kwargs = {"run_id": saved_ids[name]}
        args = (project, str(run_dir)) if cls.requires_logging_directory else (project,)
        tracker = cls(*args, **kwargs)
        tracker.start()
        self._trackers[name] = tracker
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
