"""Which folder a run writes to, so that runs never mix and a stopped run is found again.

- `output_dir` set: that folder. `resume=auto` continues the run in it (checkpoint.check_compatible refuses
  a changed config); `resume=none` refuses a folder that already holds a run instead of appending to it.
- `output_dir` empty: a new folder `outputs/<recipe>/<date-time>`, made unique with `-2`, `-3`, ... by an
  exclusive `mkdir`, so six runs started in one second get six folders. From its start until it completes,
  a marker `outputs/<recipe>/.preempted/<identity>` names the run's folder, where the identity is a hash of
  the recipe and its resolved config's settings away from their defaults (run-control keys aside): re-running
  the same command continues that run whether it was preempted, killed (SIGKILL, out of memory, a launcher's
  timeout) or crashed, and the marker is removed when the run completes. The running process holds a lock on
  the marker (flock, dropped by the kernel when the process dies), so the same command started while the first
  still runs gets a new folder instead of writing into the running one.
- Either way, a run asked to resume a folder that holds a run but no complete checkpoint says so in one line
  (`no complete checkpoint in X: starting at step 0`) instead of starting over silently.

Only the main process decides (these functions touch the file system); training.py shares the answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path

from accel_trainer.checkpoint import files
from accel_trainer.config.fields import declared_defaults
from accel_trainer.config.train_config import TrainConfig, config_to_dict
from accel_trainer.errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the same command run twice at once would share a folder
    fcntl = None  # type: ignore[assignment]

OUTPUTS = Path("outputs")
# Keys that say where and how a run is driven, not which run it is.
RUN_CONTROL_KEYS = frozenset({"output_dir", "resume", "show_progress_bar"})
_held: dict[Path, int] = {}  # marker -> the open descriptor whose lock says "this command is running here"


def choose(recipe_name: str, cfg: TrainConfig) -> Path:
    """The run folder: `output_dir`, the unfinished run of this same command, or a new unique folder.

    A default folder's marker stays locked by this process until `release`.

    Raises:
        UserError: `resume=none` names a folder that already holds a run.
    """
    if cfg.output_dir:
        folder = Path(cfg.output_dir)
        if cfg.resume == "none" and holds_a_run(folder):
            raise UserError(
                f"output_dir {folder} already holds a run and resume=none would mix a second one into it;"
                " choose a new output_dir (or resume=auto to continue that run)"
            )
        _say_if_starting_over(folder, cfg)
        return folder
    marker = preempted_marker(recipe_name, cfg)
    descriptor = _hold(marker)  # None: the same command is running now, elsewhere; leave its run alone
    recorded = os.read(descriptor, 4096).decode().strip() if descriptor is not None else ""
    if cfg.resume == "auto" and recorded and Path(recorded).is_dir():
        print(f"continuing the unfinished run in {recorded} (the same command; resume=none starts anew)", flush=True)
        _say_if_starting_over(Path(recorded), cfg)
        return Path(recorded)
    folder = _new_folder(OUTPUTS / recipe_name / time.strftime("%Y%m%d-%H%M%S"))
    if descriptor is not None:
        os.ftruncate(descriptor, 0)
        os.lseek(descriptor, 0, os.SEEK_SET)
        os.write(descriptor, str(folder).encode())
    return folder


def release(recipe_name: str, cfg: TrainConfig, run_dir: Path | None, completed: bool) -> None:
    """The run has ended: unlock this command's marker, and remove it when the run completed or left no folder
    (a run stopped in any other way is continued by the same command)."""
    marker = preempted_marker(recipe_name, cfg)
    descriptor = _held.pop(marker, None)
    if descriptor is None:
        return
    if completed or run_dir is None or not run_dir.is_dir():
        marker.unlink(missing_ok=True)
        for folder in (marker.parent, marker.parent.parent, OUTPUTS):  # .preempted, outputs/<recipe>, outputs
            with contextlib.suppress(OSError):  # only when empty: a failed first run leaves no trace
                folder.rmdir()
    os.close(descriptor)


def discard_unstarted(folder: Path, refused: bool) -> None:
    """Remove a folder this run created and that holds no run (no metrics, no checkpoint): a refused run's
    (`refused`: a UserError) whatever it wrote there (config.yaml, run_info.json, ...), so that the next run in it
    starts clean; a crashed run's only when empty (what it wrote says what happened)."""
    with contextlib.suppress(OSError):
        if refused and not holds_a_run(folder):
            shutil.rmtree(folder)
        else:
            folder.rmdir()


def holds_a_run(folder: Path) -> bool:
    return (folder / "metrics.jsonl").is_file() or (folder / "checkpoints").is_dir()


def identity(recipe_name: str, cfg: TrainConfig) -> str:
    """A short hash of the recipe and the settings of its resolved config away from their defaults, run-control
    keys aside: a setting a later version adds (at its default) leaves a stopped run's identity as it was, so the
    same command still continues it after an upgrade."""
    defaults = declared_defaults(type(cfg))
    settings = [
        (key, value)
        for key, value in config_to_dict(cfg).items()
        if key not in RUN_CONTROL_KEYS and (key not in defaults or value != defaults[key])
    ]
    return hashlib.sha256(repr([recipe_name, *settings]).encode()).hexdigest()[:16]


def preempted_marker(recipe_name: str, cfg: TrainConfig) -> Path:
    return OUTPUTS / recipe_name / ".preempted" / identity(recipe_name, cfg)


def _hold(marker: Path) -> int | None:
    """Open and lock `marker` for this run (kept in `_held`); None when another process holds it."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(marker, os.O_RDWR | os.O_CREAT, 0o666)
    if fcntl is not None:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            return None
    _held[marker] = descriptor
    return descriptor


def _say_if_starting_over(folder: Path, cfg: TrainConfig) -> None:
    """One line when a run asked to resume finds an earlier run's files but no complete checkpoint to resume."""
    if cfg.resume == "auto" and holds_a_run(folder) and not files.complete_checkpoints(folder):
        print(f"accel-trainer: no complete checkpoint in {folder}: starting at step 0", flush=True)


def _new_folder(base: Path) -> Path:
    base.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 10_000):
        folder = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            folder.mkdir()  # exclusive: a concurrent run that took this name makes it fail
            return folder
        except FileExistsError:
            continue
    raise UserError(f"could not create a new run folder next to {base}; set output_dir")
