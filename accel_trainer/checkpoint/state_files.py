"""State without pickle: tensors in safetensors, numbers, strings and structure in JSON.

Optimizer, LR-scheduler, gradient-scaler and RNG states are nested dicts, lists and tuples of tensors and
plain values. `torch.save` pickles them, and unpickling runs whatever code the file names, so a checkpoint
anyone else could write (a shared file system, a downloaded run) would be a way to run code on `resume=`.
Here a state is split into its tensors, keyed by their path in the tree, and a JSON *skeleton* in which each
tensor is a reference; `save` writes both into one safetensors file (the skeleton in its header metadata),
and `load` reads them back with no code run at all. Tuples, non-string dict keys and numpy arrays (numpy's
RNG state) are tagged in the skeleton, so a state comes back with the types it had.

    state_files.save(optimizer_state, folder / "optimizer.safetensors")
    optimizer_state = state_files.load(folder / "optimizer.safetensors")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from accel_trainer.errors import UserError
from accel_trainer.parallel.sharding import local_part

SKELETON_KEY = "accel_trainer.skeleton"
TENSOR, TUPLE, DICT, NDARRAY = "__tensor__", "__tuple__", "__dict__", "__ndarray__"
_TAGS = {TENSOR, TUPLE, DICT, NDARRAY}


class StateFileError(UserError):
    """A state holds a value that cannot be stored without pickle, or a state file is malformed."""


def split(tree: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON-ready skeleton of `tree` and its tensors, keyed `<prefix>/<path>` (sharded ones stay DTensors).

    Raises:
        StateFileError: a value that is neither a tensor, a number, a string, None, a numpy array, nor a
            dict, list or tuple of those (a function or an arbitrary object would need pickle).
    """
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(tree, prefix, tensors)
    return skeleton, tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The tree `split` took apart, with each tensor reference replaced by `tensors[key]`.

    Raises:
        StateFileError: a referenced tensor is missing.
    """
    if isinstance(skeleton, list):
        return [join(item, tensors) for item in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if len(skeleton) == 1 and next(iter(skeleton)) in _TAGS:
        tag, value = next(iter(skeleton.items()))
        if tag == TENSOR:
            if value not in tensors:
                raise StateFileError(f"the saved state refers to tensor {value!r}, which is not there")
            return tensors[value]
        if tag == TUPLE:
            return tuple(join(item, tensors) for item in value)
        if tag == NDARRAY:
            return np.asarray(value["data"], dtype=value["dtype"])
        return {join(key, tensors): join(item, tensors) for key, item in value}
    return {key: join(item, tensors) for key, item in skeleton.items()}


def tensor_keys(skeleton: Any) -> list[str]:
    """The keys of the tensors a skeleton refers to, in order."""
    if isinstance(skeleton, list):
        return [key for item in skeleton for key in tensor_keys(item)]
    if not isinstance(skeleton, dict):
        return []
    if len(skeleton) == 1 and TENSOR in skeleton:
        return [skeleton[TENSOR]]
    return [key for item in skeleton.values() for key in tensor_keys(item)]


def save(tree: Any, path: Path, prefix: str = "") -> None:
    """Write `tree` into one safetensors file: its tensors, and its skeleton in the header metadata."""
    skeleton, tensors = split(tree, prefix)
    save_file(writable(tensors), str(path), metadata={SKELETON_KEY: json.dumps(skeleton)})


def save_skeleton(skeleton: Any, path: Path) -> None:
    """Write a state file that holds only a skeleton (its tensors are stored elsewhere, e.g. sharded)."""
    save_file({}, str(path), metadata={SKELETON_KEY: json.dumps(skeleton)})


def load_skeleton(path: Path) -> Any:
    """The skeleton a state file holds, without reading its tensors.

    Raises:
        StateFileError: the file is not a safetensors file written by `save`.
    """
    try:
        with safe_open(str(path), framework="pt") as stream:
            return json.loads((stream.metadata() or {})[SKELETON_KEY])
    except (OSError, SafetensorError) as error:
        raise StateFileError(f"{path} is not a readable safetensors file ({error})") from None
    except (KeyError, ValueError, TypeError):
        raise StateFileError(f"{path} is not a state file of accel-trainer (no valid {SKELETON_KEY})") from None


def load(path: Path) -> Any:
    """Read a state file written by `save` (no pickle: nothing in the file can run code).

    Raises:
        StateFileError: the file is not a state file, or its skeleton and tensors disagree.
    """
    skeleton = load_skeleton(path)
    with safe_open(str(path), framework="pt") as stream:
        tensors = {key: stream.get_tensor(key) for key in stream.keys()}  # noqa: SIM118 - not a dict
    return join(skeleton, tensors)


def _split(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise StateFileError(f"two tensors of the state would be stored under one key, {path!r}")
        tensors[path] = value
        return {TENSOR: path}
    if isinstance(value, np.ndarray):
        return {NDARRAY: {"dtype": value.dtype.str, "data": value.tolist()}}
    if isinstance(value, np.generic):  # numpy scalars, np.float64 included, as plain Python numbers
        return value.item()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, tuple):
        return {TUPLE: [_split(item, f"{path}/{index}", tensors) for index, item in enumerate(value)]}
    if isinstance(value, list):
        return [_split(item, f"{path}/{index}", tensors) for index, item in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and not _TAGS & set(value):
            return {key: _split(item, f"{path}/{key}", tensors) for key, item in value.items()}
        return {
            DICT: [
                [_split(key, f"{path}/key{index}", tensors), _split(item, f"{path}/{key}", tensors)]
                for index, (key, item) in enumerate(value.items())
            ]
        }
    raise StateFileError(
        f"cannot store {path.lstrip('/') or 'the state'} ({type(value).__name__}) in a checkpoint: only tensors,"
        " numbers, strings, None, numpy arrays and dicts, lists and tuples of them are stored (no pickle)"
    )


def writable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors safetensors can write: contiguous, and tied or shared storage stored as separate copies.

    Works on sharded (DTensor) values too, whose local shards are what a sharded save writes.
    """
    seen: set[int] = set()
    result = {}
    for name, tensor in tensors.items():
        local = local_part(tensor)
        pointer = local.untyped_storage().data_ptr()
        tensor = tensor.detach()
        result[name] = tensor.clone() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    return result
