"""Checkpoint folders on disk: atomic publication, verification, the `latest` pointer and retention.

A checkpoint is written into `checkpoints/.tmp-step_XXXXXXXX/`, every file is fsynced, a `manifest.json` of
file sizes and sha256 checksums is written *last*, and only then is the folder renamed to
`checkpoints/step_XXXXXXXX/` and the `latest` file replaced atomically. A kill -9 at any moment therefore
leaves either a temporary folder (ignored and cleaned up) or a complete, verifiable checkpoint, and the
previous checkpoint is never touched before the new one is complete (unlike accelerate's `total_limit`,
which deletes first: docs/accelerate-traps.md). Progress is read from the checkpoint's `train_state.json`, never parsed
from a folder name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

from accel_trainer.errors import UserError

# The process's umask, read once at import (reading it means setting it, which is not thread-safe later).
_UMASK = os.umask(0o022)
os.umask(_UMASK)
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or corrupt, or does not fit this run."""


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_folder_name(step: int) -> str:
    return f"step_{step:08d}"


def temporary_folder(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"{TMP_PREFIX}{step_folder_name(step)}"


def final_folder(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / step_folder_name(step)


def publish(temporary: Path) -> Path:
    """Fsync the files, write the manifest last, rename into place and point `latest` at it."""
    files = sorted(p for p in temporary.rglob("*") if p.is_file())
    follow_umask(*files)
    manifest = {str(p.relative_to(temporary)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    for path in files:
        _fsync_file(path)
    _write_durably(temporary / MANIFEST, json.dumps({"files": manifest}, indent=1))
    final = temporary.with_name(temporary.name[len(TMP_PREFIX) :])
    replaced = final.with_name(f"{TMP_PREFIX}replaced-{final.name}")
    if final.exists():  # the same step from an earlier attempt: move it aside first, so a crash leaves a .tmp-
        os.replace(final, replaced)
    os.replace(temporary, final)
    shutil.rmtree(replaced, ignore_errors=True)
    _fsync_dir(final.parent)
    _write_durably(final.parent / LATEST, final.name, atomic=True)
    return final


def follow_umask(*paths: Path) -> None:
    """Give files the mode the umask gives any file the user writes (0644 under umask 022).

    safetensors writes its files with mode 0600, so a teammate on shared storage could not read a model
    whose folder they can list.
    """
    for path in paths:
        os.chmod(path, 0o666 & ~_UMASK)


def verify(folder: Path) -> None:
    """Raise CheckpointError naming the first problem: no manifest, a missing, truncated or altered file."""
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {folder} is incomplete (no {MANIFEST}: the save was interrupted)")
    try:
        files = {
            str(name): (int(entry["bytes"]), str(entry["sha256"]))
            for name, entry in json.loads(manifest_path.read_text())["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or JSON of the wrong shape
        raise CheckpointError(f"checkpoint {folder} has a corrupt {MANIFEST}") from None
    for name, (size, sha256) in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {name}")
        if path.stat().st_size != size:
            actual = path.stat().st_size
            raise CheckpointError(f"checkpoint {folder}: {name} has {actual} bytes, not {size} (truncated or altered)")
        if _sha256(path) != sha256:
            raise CheckpointError(f"checkpoint {folder}: {name} does not match its checksum (corrupt)")


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Published checkpoint folders (temporary ones excluded), oldest first by their recorded step."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    candidates = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(TMP_PREFIX)]
    return sorted(candidates, key=recorded_step)


def recorded_step(folder: Path) -> int:
    """The step a checkpoint holds, from its train_state.json (-1 if unreadable)."""
    try:
        return int(json.loads((folder / "train_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def newest_valid_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; incomplete or corrupt ones are skipped with a warning."""
    for folder in reversed(complete_checkpoints(run_dir)):
        try:
            verify(folder)
            return folder
        except CheckpointError as problem:
            warnings.warn(f"accel-trainer: skipping {problem}", stacklevel=2)
    return None


def remove_stale_temporaries(run_dir: Path) -> None:
    """Delete temporary folders left by interrupted saves."""
    folder = checkpoints_dir(run_dir)
    if folder.is_dir():
        for stale in folder.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)


def apply_retention(run_dir: Path, keep_last: int, best: Path | None) -> None:
    """Keep the newest `keep_last` checkpoints (0 keeps all) and `best`; never delete the newest one."""
    if keep_last <= 0:
        return
    checkpoints = complete_checkpoints(run_dir)
    if not checkpoints:
        return
    # The checkpoint just published is the one `latest` names; after resuming past a corrupt checkpoint it
    # is not the highest recorded step, and deleting it would leave nothing valid to resume from.
    pointer = checkpoints_dir(run_dir) / LATEST
    newest = checkpoints_dir(run_dir) / pointer.read_text().strip() if pointer.is_file() else checkpoints[-1]
    keep = set(checkpoints[-keep_last:]) | {newest}
    if best is not None:
        keep.add(best)
    for folder in checkpoints:
        if folder not in keep:
            shutil.rmtree(folder, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_durably(path: Path, text: str, atomic: bool = False) -> None:
    target = path.with_name(path.name + ".tmp") if atomic else path
    with open(target, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    if atomic:
        os.replace(target, path)
    _fsync_dir(path.parent)
