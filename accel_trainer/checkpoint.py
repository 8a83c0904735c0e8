"""What a checkpoint holds, and saving and restoring it on any layout.

A checkpoint folder (`checkpoints/step_00000120/`) holds no pickle, so loading one cannot run code:
    model.safetensors                  full weights (1 process or DDP), or
    distributed/                       per-rank safetensors shards of model and optimizer (FSDP), written and
                                       resharded on load by torch.distributed.checkpoint's HF storage
    optimizer.safetensors              the optimizer state (state_files.py: tensors, JSON structure); under
                                       FSDP only its structure, the tensors being in distributed/
    trainer.safetensors                LR scheduler and fp16 gradient-scaler state
    rng_rank<r>.safetensors            every process's RNG states (python, numpy, torch, cuda)
    train_state.json                   format, step, epoch, samples seen, recipe, config and its hash, world
                                       size, layout, parameter shapes; the data position is derived from the step
    config.yaml, manifest.json         the resolved config; sizes and checksums, written last

Model and optimizer go through torch's layout-independent state-dict API (`get_state_dict` /
`set_state_dict`, keyed by parameter names without DDP, FSDP or checkpoint-wrapper prefixes), and a sharded
checkpoint is resharded on load, so a checkpoint written on one layout resumes on another: FSDP to 1 process
or DDP and back. accelerate's `save_state` is not used because its non-FSDP files cannot be loaded into FSDP,
it pickles (torch.save, and DCP's default format pickles its metadata), and it restores RNG states at the
wrong moment for an exact mid-epoch resume (docs/accelerate-traps.md). A checkpoint of the earlier pickle
format, or one holding any file accel-trainer does not write, is refused with one line.
"""

from __future__ import annotations

import functools
import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from . import checkpoint_files as files
from . import state_files
from .background_writer import BackgroundWriter
from .checkpoint_checks import FORMAT, TRAIN_STATE, check_compatible, check_format, config_hash
from .checkpoint_files import CheckpointError
from .config import TrainConfig, config_to_dict, config_to_yaml
from .layout import LayoutSettings, layout_to_dict
from .pipeline_split import tied_groups
from .pipeline_state import merge_optimizer_skeletons, restrict_optimizer_skeleton
from .rng_states import capture_rng_states, rng_file_name
from .sharding import is_sharded, tied_names
from .train_state import TrainState

SHARDED = "distributed"
OPTIMIZER = "optimizer.safetensors"
TRAINER = "trainer.safetensors"
MODEL_PREFIX = "model/"  # keys of the model's tensors among the sharded files' (the optimizer's: "optimizer/")


@dataclass(frozen=True)
class Trained:
    """The prepared objects whose state a checkpoint holds."""

    model: torch.nn.Module
    optimizer: Any  # accelerate's AcceleratedOptimizer
    scheduler: Any
    whole: torch.nn.Module | None = None  # on a pipeline layout, the model whose stages `model` holds a part of

    def shapes_and_ties(self, model_state: dict[str, Any]) -> tuple[dict[str, Any], list[list[str]]]:
        """The state whose shapes a checkpoint records and checks, and the groups of tied names: the whole
        model's on a pipeline layout (each process's own state holds only its stages)."""
        if self.whole is None:
            return model_state, tied_names(model_state)
        return self.whole.state_dict(), [sorted(names) for names in tied_groups(self.whole)]


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint records about the run that wrote it, and checks on resume."""

    recipe_name: str
    cfg: TrainConfig
    layout: LayoutSettings


def save(
    accelerator: Accelerator, run_dir: Path, state: TrainState, trained: Trained, identity: RunIdentity, *,
    writer: BackgroundWriter | None = None, after_publish: Callable[[], None] | None = None,
) -> Path:  # fmt: skip
    """Write and publish the checkpoint of `state.step` (every process takes part); returns its folder.

    With a `writer`, the main process snapshots the full model and optimizer state in host memory and writes
    them, publishes and runs `after_publish` (retention) in the background, so training continues during
    the write. A sharded (FSDP, tensor-parallel) save is always synchronous: it needs collectives.
    """
    step, sharded = state.step, is_sharded(accelerator, trained.model)
    temporary = files.temporary_folder(run_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    problem = _agree(accelerator, _attempt(lambda: _prepare_folder(accelerator, temporary, writer)))
    if problem is None:
        model_state: Any
        model_state, optimizer_state = get_state_dict(trained.model, trained.optimizer.optimizer)
        heavy_writes: list[Callable[[], None]] = []

        def write_local_files() -> None:
            heavy_writes.extend(_write_tensors(accelerator, temporary, model_state, optimizer_state, writer, sharded,
                                               pipeline=trained.whole is not None))  # fmt: skip
            state_files.save(capture_rng_states(), temporary / rng_file_name(accelerator.process_index))
            if accelerator.is_main_process:
                _write_small_files(accelerator, temporary, state, trained.scheduler, identity,
                                   *trained.shapes_and_ties(model_state))  # fmt: skip

        problem = _agree(accelerator, _attempt(write_local_files))

    def finish() -> None:
        for write in heavy_writes:
            write()
        files.publish(temporary)
        if after_publish is not None:
            after_publish()

    # Decided alike on every process: a background write (the main process's only) needs no agreement now;
    # its failure is raised by writer.wait() at the next save, where the processes agree on it.
    in_background = writer is not None and not sharded
    if problem is None and in_background:
        if accelerator.is_main_process:
            writer.start(finish)  # type: ignore[union-attr]
    elif problem is None:
        problem = _agree(accelerator, _attempt(finish) if accelerator.is_main_process else None)
    if problem is not None:
        _stop_after_failed_save(accelerator, run_dir, temporary, step, problem)
    return files.final_folder(run_dir, step)


def _stop_after_failed_save(accelerator: Accelerator, run_dir: Path, temporary: Path, step: int, problem: str) -> None:
    """Remove the half-written folder (so resume=auto never meets it) and raise one line saying what is left."""
    newest = None
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
        newest = files.newest_valid_checkpoint(run_dir)
    raise CheckpointError(
        f"saving the checkpoint of step {step} in {files.checkpoints_dir(run_dir)} failed ({problem}); the run"
        f" stopped, its newest complete checkpoint {'is ' + newest.name if newest else 'is unchanged'}"
    )


def _prepare_folder(accelerator: Accelerator, temporary: Path, writer: BackgroundWriter | None) -> None:
    """The main process waits for the last background write (raising its failure) and makes the folder."""
    if accelerator.is_main_process:
        if writer is not None:
            writer.wait()
        temporary.mkdir(parents=True)


def _write_tensors(
    accelerator: Accelerator, temporary: Path, model_state: Any, optimizer_state: Any,
    writer: BackgroundWriter | None, sharded: bool, pipeline: bool = False,
) -> list[Callable[[], None]]:  # fmt: skip
    """Write the sharded tensors (every process), or return the main process's writes of full ones."""
    if sharded:
        optimizer_skeleton, optimizer_tensors = state_files.split(optimizer_state, "optimizer")
        if pipeline:  # each process holds the optimizer state of its own stages
            optimizer_skeleton = merge_optimizer_skeletons(gather_object([optimizer_skeleton]))
        tensors = {**{MODEL_PREFIX + name: tensor for name, tensor in model_state.items()}, **optimizer_tensors}
        dcp.save(
            state_files.writable(tensors),
            storage_writer=HuggingFaceStorageWriter(str(temporary / SHARDED), save_distributed=True),
        )
        if accelerator.is_main_process:
            state_files.save_skeleton(optimizer_skeleton, temporary / OPTIMIZER)
        return []
    if not accelerator.is_main_process:
        return []
    if writer is not None:
        staged = writer.snapshot({"model": model_state, "optimizer": optimizer_state})
        weights, optimizer_copy = staged["model"], staged["optimizer"]
    else:
        weights, optimizer_copy = state_files.writable(model_state), optimizer_state
    return [
        functools.partial(save_file, weights, str(temporary / "model.safetensors")),
        functools.partial(state_files.save, optimizer_copy, temporary / OPTIMIZER, "optimizer"),
    ]


def _attempt(work: Callable[[], None]) -> str | None:
    """Run file work; return what went wrong, in a line, instead of raising (the processes must agree first)."""
    try:
        work()
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - a full disk, a size limit, read-only, ...
        cause: BaseException = error
        if isinstance(error, CheckpointException) and error.failures:  # per rank: (exception, stack summary)
            cause = next(iter(error.failures.values()))[0]
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    return None


def _agree(accelerator: Accelerator, problem: str | None) -> str | None:
    """Every process learns the first problem any of them had, so that all stop together instead of hanging."""
    if accelerator.num_processes == 1:
        return problem
    problems = [p for p in gather_object([problem]) if p is not None]
    return problems[0] if problems else None


def _write_small_files(
    accelerator: Accelerator, temporary: Path, state: TrainState, scheduler: Any, identity: RunIdentity,
    model_state: dict[str, Any], tied: list[list[str]],
) -> None:  # fmt: skip
    scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
    state_files.save({"scheduler": scheduler.state_dict(), "scaler": scaler}, temporary / TRAINER)
    recorded = {
        "format": FORMAT,
        **state.to_dict(),
        "recipe": identity.recipe_name,
        "config_hash": config_hash(identity.cfg),
        "world_size": accelerator.num_processes,
        "layout": {"distributed_type": accelerator.distributed_type.value,
                   "mixed_precision": accelerator.mixed_precision, **layout_to_dict(identity.layout)},
        "parameter_shapes": {name: list(t.shape) for name, t in model_state.items()},
        "tied_parameters": tied,
        "config": config_to_dict(identity.cfg),
    }  # fmt: skip
    (temporary / TRAIN_STATE).write_text(json.dumps(recorded, indent=1))
    (temporary / "config.yaml").write_text(config_to_yaml(identity.cfg))


def restore(
    accelerator: Accelerator, folder: Path, trained: Trained, identity: RunIdentity
) -> tuple[TrainState, dict[str, Any] | None]:
    """Load a verified checkpoint into the prepared objects.

    Returns its train state and this process's saved RNG states, which the caller applies at the moment that
    matches the uninterrupted run (see loop.py); None when the process count changed, after a warning.

    Raises:
        CheckpointError: the checkpoint is incomplete or corrupt, or belongs to another recipe or model shape.
    """
    problem: list[str | None] = [None]
    if accelerator.is_main_process:
        try:
            files.verify(folder)
            check_format(folder)
        except CheckpointError as error:
            problem[0] = str(error)
    if accelerator.num_processes > 1:
        broadcast_object_list(problem)
    if problem[0]:
        raise CheckpointError(problem[0])
    model_state: Any
    model_state, optimizer_state = get_state_dict(trained.model, trained.optimizer.optimizer)
    cfg = identity.cfg
    try:  # the manifest proves integrity, not content: a folder written by someone else may not fit
        recorded = json.loads((folder / TRAIN_STATE).read_text())
        check_compatible(recorded, identity.recipe_name, cfg, trained.shapes_and_ties(model_state)[0],
                         same_run=cfg.resume == "auto", warn=accelerator.is_main_process)  # fmt: skip
        rng_states = _load(accelerator, folder, recorded, trained, model_state, optimizer_state)
        return TrainState.from_dict(recorded), rng_states
    except (OSError, SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {type(error).__name__}: {error}") from None


def _load(
    accelerator: Accelerator, folder: Path, recorded: dict[str, Any], trained: Trained, model_state: Any,
    optimizer_state: Any,
) -> dict[str, Any] | None:  # fmt: skip
    """Load model, optimizer, schedule and scaler from a checked checkpoint; return this process's RNG states."""
    optimizer_skeleton = state_files.load_skeleton(folder / OPTIMIZER)
    sources: dict[str, str] = {}
    if trained.whole is not None:  # a pipeline process loads the part of its stages
        optimizer_skeleton, sources = restrict_optimizer_skeleton(
            optimizer_skeleton, _optimizer_names(optimizer_state), recorded.get("tied_parameters", [])
        )
    if (folder / SHARDED).is_dir():
        optimizer_state = _load_sharded(folder, model_state, optimizer_state, optimizer_skeleton, sources)
        options = None
    else:  # full tensors, which set_state_dict shards itself when this run is FSDP
        model_state = load_file(str(folder / "model.safetensors"))
        optimizer_state = state_files.load(folder / OPTIMIZER)
        options = StateDictOptions(full_state_dict=True)
        if trained.whole is not None:
            held = set(trained.model.state_dict())
            model_state = {name: tensor for name, tensor in model_state.items() if name in held}
            saved = state_files.split(optimizer_state, "optimizer")[1]
            keys = state_files.tensor_keys(optimizer_skeleton)
            optimizer_state = state_files.join(optimizer_skeleton, {key: saved[sources.get(key, key)] for key in keys})
            options = None
    set_state_dict(trained.model, trained.optimizer.optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state, options=options)  # fmt: skip
    trainer = state_files.load(folder / TRAINER)
    trained.scheduler.load_state_dict(trainer["scheduler"])
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


def _optimizer_names(optimizer_state: dict[str, Any]) -> list[str]:
    """The parameter names of an optimizer state dict (torch's get_state_dict form), in its groups' order."""
    return [name for group in optimizer_state.get("param_groups", []) for name in group["params"]]


def _load_sharded(folder: Path, model_state: dict[str, Any], optimizer_state: dict[str, Any],
                  optimizer_skeleton: Any, sources: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Load the sharded tensors in place into this run's (possibly sharded) state; returns the optimizer's.
    `sources` maps a key of this run's optimizer state to the key it was saved under, where they differ."""
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
    dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(folder / SHARDED)))
    return state_files.join(optimizer_skeleton, live_optimizer_tensors)
