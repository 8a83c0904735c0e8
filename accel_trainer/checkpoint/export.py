"""Export: one consolidated `model.safetensors` plus `config.yaml` from any checkpoint, sharded or not.

    accel-trainer export outputs/gpt/run1                      # the run's newest complete checkpoint
    accel-trainer export outputs/gpt/run1/checkpoints/step_00000500 --output exported/gpt

A checkpoint that holds only the trainable weights (LoRA: checkpoint/frozen.py) needs its recipe to read the
frozen base again: `accel-trainer export` does that (commands.evaluate.export_run), writing a peft model as the
run's final/ is written, the merged model plus `adapter/`; `export` here refuses it in one line.

Runs in one process without a process group: the shards of a sharded (FSDP) checkpoint are read from disk
by torch.distributed.checkpoint's HF safetensors reader into full-size tensors. Only safetensors, JSON and
YAML are read, so an export runs no code from the checkpoint; that makes it the way to keep the weights of
an unsharded checkpoint of the earlier pickle format, which `resume=` refuses.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from accel_trainer.checkpoint import checks, files, frozen, save, state_files
from accel_trainer.checkpoint.files import CheckpointError


def export(source: str | Path, output: str | Path | None = None) -> Path:
    """Write `model.safetensors` and `config.yaml` for a run folder or checkpoint folder; returns the folder.

    Raises:
        CheckpointError: no complete checkpoint there, or it is incomplete or corrupt.
    """
    folder = checkpoint_folder(Path(source))
    files.verify(folder)
    target = Path(output) if output else folder.parent.parent / "export" / folder.name
    if holds_only_trainable_weights(folder):
        raise CheckpointError(
            f"checkpoint {folder} holds only the trainable weights (its frozen base is not in it): export it with"
            " `accel-trainer export`, which rebuilds the model from its base (commands.evaluate.export_run)"
        )
    try:  # a manifest proves integrity, not content: whoever wrote the folder may have listed no files
        weights = consolidated_weights(folder)
        target.mkdir(parents=True, exist_ok=True)
        save_file(state_files.writable(weights), str(target / "model.safetensors"))
        shutil.copyfile(folder / "config.yaml", target / "config.yaml")
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {folder} cannot be exported: {type(error).__name__}: {error}") from None
    files.follow_umask(target / "model.safetensors", target / "config.yaml")
    return target


def holds_only_trainable_weights(folder: Path) -> bool:
    """Whether a checkpoint leaves its frozen weights out (checkpoint/frozen.py); False for an unreadable record,
    whose export then fails with the reason."""
    try:
        recorded = json.loads((folder / checks.TRAIN_STATE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and frozen.RECORD_KEY in recorded


def consolidated_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model weights, whole (a sharded one's shards read in this process), under every name of a
    tied tensor, as final/ holds them."""
    weights = _model_state(folder)
    for names in json.loads((folder / checks.TRAIN_STATE).read_text()).get("tied_parameters", []):
        held = [weights[name] for name in names if name in weights]
        for name in names if held else []:
            weights.setdefault(name, held[0])
    return weights


def checkpoint_folder(source: Path) -> Path:
    if (source / checks.TRAIN_STATE).is_file() or (source / files.MANIFEST).is_file():
        return source
    if files.checkpoints_dir(source).is_dir():
        found = files.newest_valid_checkpoint(source)
        if found is not None:
            return found
        raise CheckpointError(f"run folder {source} has no complete checkpoint to export")
    raise CheckpointError(f"{source} is neither a run folder nor a checkpoint folder")


def _model_state(folder: Path) -> dict[str, torch.Tensor]:
    sharded = folder / save.SHARDED
    if not sharded.is_dir():
        return load_file(str(folder / "model.safetensors"))
    if not any(sharded.glob("*.safetensors")):
        raise CheckpointError(
            f"checkpoint {folder} is a sharded checkpoint of accel-trainer 0.1, whose metadata is a pickle that"
            " could run code when loaded; it is not read"
        )
    reader = HuggingFaceStorageReader(str(sharded))
    model = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in reader.read_metadata().state_dict_metadata.items()
        if name.startswith(save.MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(model, storage_reader=reader, no_dist=True)
    return {name[len(save.MODEL_PREFIX) :]: tensor for name, tensor in model.items()}
