"""Export: one consolidated `model.safetensors` plus `config.yaml` from any checkpoint, sharded or not.

    accel-trainer export outputs/gpt/run1                      # the run's newest complete checkpoint
    accel-trainer export outputs/gpt/run1/checkpoints/step_00000500 --output exported/gpt

Runs in one process without a process group: a sharded (FSDP) checkpoint is read through torch's
`dcp_to_torch_save`, which gathers the shards of every rank from disk.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from . import checkpoint, checkpoint_files
from .checkpoint_files import CheckpointError


def export(source: str | Path, output: str | Path | None = None) -> Path:
    """Write `model.safetensors` and `config.yaml` for a run folder or checkpoint folder; returns the folder.

    Raises:
        CheckpointError: no complete checkpoint there, or it is incomplete or corrupt.
    """
    folder = _checkpoint_folder(Path(source))
    checkpoint_files.verify(folder)
    target = Path(output) if output else folder.parent.parent / "export" / folder.name
    target.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint._unshared(_model_state(folder)), str(target / "model.safetensors"))
    shutil.copyfile(folder / "config.yaml", target / "config.yaml")
    return target


def _checkpoint_folder(source: Path) -> Path:
    if (source / checkpoint.TRAIN_STATE).is_file() or (source / checkpoint_files.MANIFEST).is_file():
        return source
    if checkpoint_files.checkpoints_dir(source).is_dir():
        found = checkpoint_files.newest_valid_checkpoint(source)
        if found is not None:
            return found
        raise CheckpointError(f"run folder {source} has no complete checkpoint to export")
    raise CheckpointError(f"{source} is neither a run folder nor a checkpoint folder")


def _model_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / checkpoint.SHARDED).is_dir():
        with tempfile.TemporaryDirectory() as scratch:
            whole = Path(scratch) / "whole.pt"
            dcp_to_torch_save(folder / checkpoint.SHARDED, whole)
            return torch.load(whole, weights_only=False)["model"]
    return load_file(str(folder / "model.safetensors"))
