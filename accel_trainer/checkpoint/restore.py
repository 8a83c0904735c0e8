"""Loading a verified checkpoint (checkpoint/save.py says what it holds) into a run's prepared objects, on any layout.

Sharded checkpoints are read in place into this run's (possibly sharded) state with torch.distributed.checkpoint;
full ones through `set_state_dict`, which shards them itself under FSDP. A pipeline process loads the part of its
stages (checkpoint/pipeline_state.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.optim import optimizer as optimizer_module

from accel_trainer.checkpoint import files, state_files
from accel_trainer.checkpoint.checks import TRAIN_STATE, check_compatible, check_format
from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.checkpoint.final_weights import full
from accel_trainer.checkpoint.frozen import RECORD_KEY, FrozenWeights, check_frozen
from accel_trainer.checkpoint.pipeline_state import optimizer_part, stages_part
from accel_trainer.checkpoint.save import (
    EMA,
    EMA_PREFIX,
    MODEL_PREFIX,
    OPTIMIZER,
    SHARDED,
)
from accel_trainer.checkpoint.small_files import TRAINER
from accel_trainer.checkpoint.tokenizer import check_tokenizer
from accel_trainer.checkpoint.train_state import Stateful
from accel_trainer.checkpoint.trained import RunIdentity, Trained
from accel_trainer.data.rng import rng_file_name
from accel_trainer.parallel.sharding import is_sharded


def restore(
    accelerator: Accelerator,
    folder: Path,
    trained: Trained,
    identity: RunIdentity,
    states: tuple[Stateful, ...] = (),
) -> dict[str, Any] | None:
    """Load a verified checkpoint into the prepared objects and the registered `states` (checkpoint/train_state.py),
    in place; a state that cannot continue from its saved value (a data position this run's data cannot continue
    from) refuses it as it loads, before the tensors are loaded or anything is said.

    Returns this process's saved RNG states, which the caller applies at the moment that matches the
    uninterrupted run (see engine/loop.py); None when the process count changed, after a warning.

    Raises:
        CheckpointError: the checkpoint is incomplete or corrupt, or belongs to another recipe or model shape.
    """
    problem: list[str | None] = [None]
    if accelerator.is_main_process:
        try:
            _check_named(folder)
            files.verify(folder)
            check_format(folder)
        except CheckpointError as error:
            problem[0] = str(error)
    if accelerator.num_processes > 1:
        broadcast_object_list(problem)
    if problem[0]:
        raise CheckpointError(problem[0])
    with step_hooks_silenced(trained.optimizers.torch_optimizers()):
        return _restore_checked(accelerator, folder, trained, identity, states)


def _check_named(folder: Path) -> None:
    """A `resume=` path that is not there: said as such, with the checkpoints beside it (a step between saves)."""
    if folder.exists():
        return
    beside = sorted(path.name for path in folder.parent.glob("step_*") if path.is_dir())
    listed = f"; {folder.parent} holds {', '.join(beside)}" if beside else ""
    raise CheckpointError(f"resume={folder}: no checkpoint or run folder is there{listed}")


@contextlib.contextmanager
def step_hooks_silenced(optimizers: tuple[torch.optim.Optimizer, ...]) -> Iterator[None]:
    """Keep the recipe's optimizer step hooks (its own and torch's global ones) out of a checkpoint load.

    torch.distributed.checkpoint's `get_state_dict`/`set_state_dict` fill an optimizer that has no state yet
    by running one `optimizer.step()` with zero gradients at lr 0 (`_init_optim_state`). A recipe's step hook
    would see that phantom step on every resume, and a hook that drops some gradients (alternating updates)
    leaves those parameters without state, so the load fails with a KeyError (docs/accelerate-traps.md; the
    canary in tests/test_recipe_optimizer.py fails the day torch stops stepping).
    """
    hooks: list[dict[Any, Any]] = [
        optimizer_module._global_optimizer_pre_hooks,
        optimizer_module._global_optimizer_post_hooks,
    ]
    for optimizer in optimizers:
        hooks += [optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks]
    saved = [dict(registry) for registry in hooks]
    for registry in hooks:
        registry.clear()
    try:
        yield
    finally:
        for registry, kept in zip(hooks, saved, strict=True):
            registry.update(kept)


def _restore_checked(
    accelerator: Accelerator,
    folder: Path,
    trained: Trained,
    identity: RunIdentity,
    states: tuple[Stateful, ...],
) -> dict[str, Any] | None:
    """`restore` once the folder is verified: load it if it fits this run, else a CheckpointError."""
    model_state: Any
    model_state, optimizer_state = get_state_dict(trained.model, trained.optimizers.torch_optimizers())
    cfg = identity.cfg
    try:  # the manifest proves integrity, not content: a folder written by someone else may not fit
        recorded = json.loads((folder / TRAIN_STATE).read_text())
        check_compatible(
            recorded,
            identity.recipe_name,
            cfg,
            trained.shapes_and_ties(model_state)[0],
            same_run=cfg.resume == "auto",
            warn=accelerator.is_main_process,
        )
        check_frozen(folder, recorded, trained.frozen)
        check_tokenizer(folder, recorded, trained.tokenizer)
        for state in states:
            state.load_state_dict(recorded)
        if trained.generations is not None:
            saved_and_now = (recorded["world_size"], accelerator.num_processes)
            trained.generations.restore(folder, accelerator.process_index, recorded["step"], saved_and_now)
        return _load(accelerator, folder, recorded, trained, model_state, optimizer_state)
    except (OSError, SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {type(error).__name__}: {error}") from None


def _load(
    accelerator: Accelerator,
    folder: Path,
    recorded: dict[str, Any],
    trained: Trained,
    model_state: Any,
    optimizer_state: Any,
) -> dict[str, Any] | None:
    """Load model, optimizer, schedule and scaler from a checked checkpoint; return this process's RNG states."""
    optimizer_skeleton, sources = optimizer_part(
        state_files.load_skeleton(folder / OPTIMIZER), optimizer_state, recorded, in_pipeline=trained.whole is not None
    )
    ema = _ema_to_load(accelerator, trained, recorded)
    frozen = trained.frozen if RECORD_KEY in recorded else None  # the checkpoint holds the other weights only
    if (folder / SHARDED).is_dir():  # loaded in place into model_state's tensors; the frozen ones stay as they are
        saved = model_state if frozen is None else frozen.trainable_part(model_state)
        optimizer_state = _load_sharded(folder, saved, optimizer_state, optimizer_skeleton, sources, ema)
        options = None
    else:  # full tensors, which set_state_dict shards itself when this run is FSDP
        if ema:
            trained.ema.load_full(load_file(str(folder / EMA)))  # type: ignore[union-attr]
        model_state = _full_weights(folder, model_state, frozen)
        optimizer_state = state_files.load(folder / OPTIMIZER)
        options = StateDictOptions(full_state_dict=True)
        if trained.whole is not None:  # this process's stages' part
            model_state, optimizer_state = stages_part(
                trained.model, model_state, optimizer_state, optimizer_skeleton, sources
            )
            options = None
    _set_states(accelerator, trained, model_state, optimizer_state, options)
    if trained.ema is not None and not ema:
        trained.ema.restart_from_weights()
    trainer = state_files.load(folder / TRAINER)
    trained.optimizers.load_scheduler_states(trainer)
    if accelerator.scaler is not None and trainer["scaler"] is not None:
        accelerator.scaler.load_state_dict(trainer["scaler"])
    rng_file = folder / rng_file_name(accelerator.process_index)
    if recorded["world_size"] != accelerator.num_processes or not rng_file.is_file():
        if accelerator.is_main_process:
            warnings.warn(
                f"accel-trainer: resuming on {accelerator.num_processes} process(es) from a checkpoint of"
                f" {recorded['world_size']}: weights, optimizer and data order continue exactly, random streams"
                " (dropout, sampling) restart from the seed",
                stacklevel=2,
            )
        return None
    return state_files.load(rng_file)


def _full_weights(folder: Path, model_state: dict[str, Any], frozen: FrozenWeights | None) -> dict[str, Any]:
    """The checkpoint's model.safetensors, and where it leaves them out, the frozen weights as this run built
    them (whole tensors: the full-state-dict load wants them so)."""
    saved = load_file(str(folder / "model.safetensors"))
    if frozen is None:
        return saved
    return {**{name: full(tensor) for name, tensor in model_state.items() if name in frozen.names}, **saved}


def _set_states(
    accelerator: Accelerator, trained: Trained, model_state: Any, optimizer_state: Any, options: Any
) -> None:
    """Load the model and optimizer states into the prepared objects (torch shards them as this run holds them)."""
    optimizers = trained.optimizers.torch_optimizers()
    if len(optimizers) == 1:
        set_state_dict(
            trained.model, optimizers, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options
        )
    else:  # the model strictly; the optimizers without torch's strict check (see _several_optimizers_options)
        set_model_state_dict(trained.model, model_state, options=options)
        relaxed = _several_optimizers_options(options, is_sharded(accelerator, trained.model))
        set_optimizer_state_dict(trained.model, optimizers, optimizer_state, options=relaxed)


def _several_optimizers_options(options: StateDictOptions | None, sharded: bool) -> StateDictOptions:
    """`options` without the strict check, for loading several optimizers (two torch traps).

    torch splits a state dict of several optimizers back by parameter and, when strict, refuses a parameter
    without state; an optimizer that keeps none (SGD without momentum) then cannot be restored beside one
    that does (`RuntimeError: Missing optimizer state for parameter`). The checkpoint was already checked
    against this run (parameter names and shapes, config), so the check adds nothing here; canary:
    tests/test_several_optimizers.py::test_canary_torch_refuses_a_stateless_optimizer_beside_another. Its
    full-state-dict path also asserts that such an optimizer has a tensor ("Expected device to be set"): an
    unsharded model needs no full-state-dict handling, so it is turned off there (a full checkpoint loaded into
    an FSDP run with a stateless optimizer among several still meets it).
    """
    relaxed = dataclasses.replace(options or StateDictOptions(), strict=False)
    return relaxed if sharded else dataclasses.replace(relaxed, full_state_dict=False)


def _ema_to_load(accelerator: Accelerator, trained: Trained, recorded: dict[str, Any]) -> dict[str, Any]:
    """The run's EMA tensors to load from the checkpoint; none when either has no EMA (said when it restarts)."""
    if trained.ema is None:
        return {}
    if not recorded["config"].get("ema_decay"):
        if accelerator.is_main_process:
            warnings.warn(
                f"accel-trainer: the checkpoint of step {recorded['step']} has no EMA of the weights: the"
                " EMA starts from its weights",
                stacklevel=3,
            )
        return {}
    return trained.ema.average


def _load_sharded(
    folder: Path,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    optimizer_skeleton: Any,
    sources: dict[str, str] | None = None,
    ema: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the sharded tensors in place into this run's (possibly sharded) state; returns the optimizer's.
    `sources` maps a key of this run's optimizer state to the key it was saved under, where they differ; `ema`
    is the run's EMA to load, if any."""
    _, live_optimizer_tensors = state_files.split(optimizer_state, "optimizer")
    saved_keys = state_files.tensor_keys(optimizer_skeleton)
    unknown = [key for key in saved_keys if key not in live_optimizer_tensors]
    if unknown:
        raise CheckpointError(
            f"checkpoint {folder}: its optimizer state does not fit this run's optimizer ({unknown[0]} has no"
            " counterpart here): was it written with another optimizer?"
        )
    targets = {MODEL_PREFIX + name: tensor for name, tensor in model_state.items()}
    targets.update({(sources or {}).get(key, key): live_optimizer_tensors[key] for key in saved_keys})
    targets.update({EMA_PREFIX + name: tensor for name, tensor in (ema or {}).items()})
    with warnings.catch_warnings():  # one process loading a sharded checkpoint is what it should do
        warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent is to load")
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(folder / SHARDED)))
    return state_files.join(optimizer_skeleton, live_optimizer_tensors)
