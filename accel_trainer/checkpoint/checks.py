"""Whether a checkpoint may be loaded at all, and whether it fits this run.

A checkpoint of the earlier pickle format, or holding any file accel-trainer does not write, is refused
with one line: loading it could run code. One written by another recipe or model shape is refused by
name; changed config keys are refused when continuing the same run folder (resume=auto) and warned about
when starting from a named checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.checkpoint.run_folder import RUN_CONTROL_KEYS
from accel_trainer.config.fields import declared_defaults
from accel_trainer.config.train_config import TrainConfig, config_to_dict, config_to_yaml

TRAIN_STATE = "train_state.json"
# The checkpoint format: 2 is pickle-free. Format 1 (accel-trainer 0.1, no "format" key) pickled optimizer,
# scheduler, RNG and DCP metadata, and is refused on resume.
FORMAT = 2
SAFE_SUFFIXES = (".safetensors", ".json", ".yaml")
# Keys that change how a run is driven or recorded, not its trajectory: changing them on resume is routine.
_BOOKKEEPING_KEYS = RUN_CONTROL_KEYS | {
    "log_every_steps",
    "eval_every_steps",
    "save_every_steps",
    "keep_last",
    "keep_best_metric",
    "keep_best_mode",
    "async_save",
    "num_dataloader_workers",
    "num_prefetch_batches",
    "stream_split",  # the stream position a checkpoint holds says how it was read, and refuses the other way
    "trackers",
    "profile_steps",
    "max_time",
    "data_cache_gb",
    "evaluate_ema",
    "eval_tasks",
    "skip_nonfinite_steps",
    "max_nonfinite_in_a_row",
    "report",
}
# max_steps (extending a run): changing it continues the run, with a warning. The layout settings are not
# config keys: a checkpoint resumes on another layout.
_CONTINUABLE_KEYS = {"max_steps"}


def check_format(folder: Path) -> None:
    """Refuse a checkpoint of the pickle format, or one holding any file accel-trainer does not write.

    Raises:
        CheckpointError: naming the files, why they are refused and what to do instead.
    """
    try:
        version = json.loads((folder / TRAIN_STATE).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        raise CheckpointError(f"checkpoint {folder} has no readable {TRAIN_STATE}") from None
    if version is None:
        raise CheckpointError(
            f"checkpoint {folder} has the format of accel-trainer 0.1, whose optimizer, RNG and sharded files are"
            " pickles that could run code when loaded, so it is not loaded; start a new run (a new output_dir),"
            f" and keep the weights of an unsharded one with `accel-trainer export {folder}`"
        )
    if version != FORMAT:
        raise CheckpointError(f"checkpoint {folder} has format {version}; this accel-trainer reads format {FORMAT}")
    foreign = sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and not p.name.endswith(SAFE_SUFFIXES)
    )
    if foreign:
        raise CheckpointError(
            f"checkpoint {folder} holds {', '.join(foreign)}, which accel-trainer never writes (it could be a"
            " pickle that runs code when loaded), so it is refused; remove the file if you know where it came from"
        )


def check_compatible(
    state: dict[str, Any], recipe_name: str, cfg: TrainConfig, model_state: dict, *, same_run: bool, warn: bool = True
) -> None:
    """Refuse another recipe or model shape by name; refuse or warn about config keys that changed.

    With `same_run` (resume=auto: continuing the run in its own folder) a changed key that alters the
    trajectory (lr, seed, batch sizes, recipe fields) is refused, since the folder would then mix two runs;
    a checkpoint named explicitly (resume=<path>) is a starting point, and such changes are only warned about.
    A key the checkpoint does not hold (a field added to the recipe or the framework since) is a change only
    where this run sets it away from its default.
    """
    if state["recipe"] != recipe_name:
        raise CheckpointError(f"the checkpoint was written by recipe {state['recipe']!r}, not {recipe_name!r}")
    saved, defaults = state["config"], declared_defaults(type(cfg))
    changed = {
        key: (saved.get(key), value)
        for key, value in config_to_dict(cfg).items()
        if key not in _BOOKKEEPING_KEYS and (saved[key] != value if key in saved else defaults.get(key) != value)
    }
    listed = {key: f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items()}
    if same_run and set(changed) - _CONTINUABLE_KEYS:
        refused = ", ".join(line for key, line in listed.items() if key not in _CONTINUABLE_KEYS)
        raise CheckpointError(
            f"the run in this output_dir was trained with another config ({refused}); resume=auto continues only"
            " the same run: use a new output_dir for a new run, or resume=<checkpoint> with a new output_dir to"
            " start from that checkpoint with the new values"
        )
    current = {name: list(t.shape) for name, t in model_state.items()}
    saved = state["parameter_shapes"]
    for name in sorted(set(saved) | set(current)):
        if saved.get(name) != current.get(name):
            raise CheckpointError(
                f"the checkpoint's model differs from this run's: parameter {name!r} has shape"
                f" {saved.get(name, 'absent')} in the checkpoint and {current.get(name, 'absent')} here"
            )
    if changed and warn:
        old_end, new_end = changed.get("max_steps", (0, 0))
        decays = cfg.lr_schedule != "constant" and isinstance(old_end, int) and new_end > old_end
        stretched = "; the LR schedule is stretched to the new max_steps from here" if decays else ""
        described = ", ".join(listed.values())
        warnings.warn(f"accel-trainer: config keys changed since the checkpoint: {described}{stretched}", stacklevel=2)


def config_hash(cfg: TrainConfig) -> str:
    return hashlib.sha256(config_to_yaml(cfg).encode()).hexdigest()[:16]
