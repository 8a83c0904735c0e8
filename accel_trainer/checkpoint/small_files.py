"""The small files of a checkpoint, which the main process writes: `train_state.json` (what the run records and
a resume checks), `config.yaml` and `trainer.safetensors` (LR schedules, gradient scaler).

Their content is taken when the save starts and the writes are returned, so that a background save
(`async_save=true`) writes them on its thread, before the main process publishes the checkpoint.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from accel_trainer.checkpoint import state_files
from accel_trainer.checkpoint.checks import FORMAT, TRAIN_STATE, config_hash
from accel_trainer.checkpoint.frozen import RECORD_KEY
from accel_trainer.checkpoint.tokenizer import RECORD_KEY as TOKENIZER_KEY
from accel_trainer.checkpoint.trained import RunIdentity, Trained
from accel_trainer.config.layout import layout_to_dict
from accel_trainer.config.train_config import config_to_dict, config_to_yaml

TRAINER = "trainer.safetensors"


def small_files(
    accelerator: Accelerator,
    temporary: Path,
    saved_states: dict[str, Any],
    trained: Trained,
    identity: RunIdentity,
    model_state: dict[str, Any],
) -> list[Callable[[], None]]:
    """The writes of the main process's small files into `temporary`, their content taken now."""
    shapes, tied = trained.shapes_and_ties(model_state)
    scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
    trainer = copy.deepcopy({**trained.optimizers.scheduler_states(), "scaler": scaler})
    recorded = {
        "format": FORMAT,
        **saved_states,
        "recipe": identity.recipe_name,
        "recipe_file": identity.recipe_file,
        "config_hash": config_hash(identity.cfg),
        "world_size": accelerator.num_processes,
        "layout": {
            "distributed_type": accelerator.distributed_type.value,
            "mixed_precision": accelerator.mixed_precision,
            **layout_to_dict(identity.layout),
        },
        "parameter_shapes": {name: list(t.shape) for name, t in shapes.items()},
        "tied_parameters": tied,
        **({RECORD_KEY: trained.frozen.record()} if trained.frozen is not None else {}),
        **({TOKENIZER_KEY: trained.tokenizer} if trained.tokenizer is not None else {}),
        "config": config_to_dict(identity.cfg),
    }
    config = config_to_yaml(identity.cfg)

    def write_trainer() -> None:
        state_files.save(trainer, temporary / TRAINER)

    def write_train_state() -> None:
        (temporary / TRAIN_STATE).write_text(json.dumps(recorded, indent=1))

    def write_config() -> None:
        (temporary / "config.yaml").write_text(config)

    return [write_trainer, write_train_state, write_config]
