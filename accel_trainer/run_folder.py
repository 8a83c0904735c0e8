"""Which folder a run writes to, so that runs never mix and a stopped run is found again.

- `output_dir` set: that folder. `resume=auto` continues the run in it (checkpoint.check_compatible refuses
  a changed config); `resume=none` refuses a folder that already holds a run instead of appending to it.
- `output_dir` empty: a new folder `outputs/<recipe>/<date-time>`, made unique with `-2`, `-3`, ... by an
  exclusive `mkdir`, so six runs started in one second get six folders. When such a run is preempted, a
  marker `outputs/<recipe>/.preempted/<identity>` names its folder, where the identity is a hash of the
  recipe and its resolved config (run-control keys aside): re-running the same command continues that run,
  and the marker is removed when the run completes.

Only the main process decides (these functions touch the file system); run.py shares the answer.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from .config import TrainConfig, config_to_yaml
from .errors import UserError

OUTPUTS = Path("outputs")
# Keys that say where and how a run is driven, not which run it is.
RUN_CONTROL_KEYS = frozenset({"output_dir", "resume", "show_progress_bar"})


def choose(recipe_name: str, cfg: TrainConfig) -> Path:
    """The run folder: `output_dir`, a preempted run of this same command, or a new unique folder.

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
        return folder
    marker = preempted_marker(recipe_name, cfg)
    if cfg.resume == "auto" and marker.is_file():
        folder = Path(marker.read_text().strip())
        if folder.is_dir():
            print(f"continuing the preempted run in {folder}", flush=True)
            return folder
    return _new_folder(OUTPUTS / recipe_name / time.strftime("%Y%m%d-%H%M%S"))


def holds_a_run(folder: Path) -> bool:
    return (folder / "metrics.jsonl").is_file() or (folder / "checkpoints").is_dir()


def identity(recipe_name: str, cfg: TrainConfig) -> str:
    """A short hash of the recipe and its resolved config, run-control keys aside."""
    lines = [line for line in config_to_yaml(cfg).splitlines() if line.split(":", 1)[0] not in RUN_CONTROL_KEYS]
    return hashlib.sha256("\n".join([recipe_name, *lines]).encode()).hexdigest()[:16]


def preempted_marker(recipe_name: str, cfg: TrainConfig) -> Path:
    return OUTPUTS / recipe_name / ".preempted" / identity(recipe_name, cfg)


def remember_preempted(recipe_name: str, cfg: TrainConfig, run_dir: Path) -> None:
    """Record a preempted run of a default folder, so that the same command continues it."""
    if cfg.output_dir:
        return
    marker = preempted_marker(recipe_name, cfg)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(run_dir))


def forget_preempted(recipe_name: str, cfg: TrainConfig) -> None:
    if not cfg.output_dir:
        preempted_marker(recipe_name, cfg).unlink(missing_ok=True)


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
