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

import copy
import functools
import hashlib
import json
import random
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from . import checkpoint_files as files
from . import state_files
from .checkpoint_files import CheckpointError
from .config import TrainConfig, config_to_dict, config_to_yaml
from .run_folder import RUN_CONTROL_KEYS

TRAIN_STATE = "train_state.json"
SHARDED = "distributed"
OPTIMIZER = "optimizer.safetensors"
TRAINER = "trainer.safetensors"
MODEL_PREFIX = "model/"  # keys of the model's tensors among the sharded files' (the optimizer's: "optimizer/")
# The checkpoint format: 2 is pickle-free. Format 1 (accel-trainer 0.1, no "format" key) pickled optimizer,
# scheduler, RNG and DCP metadata, and is refused on resume.
FORMAT = 2
SAFE_SUFFIXES = (".safetensors", ".json", ".yaml")
# Keys that change how a run is driven or recorded, not its trajectory: changing them on resume is routine.
_BOOKKEEPING_KEYS = RUN_CONTROL_KEYS | {
    "log_every_steps", "eval_every_steps", "save_every_steps", "keep_last", "keep_best_metric", "keep_best_mode",
    "async_save", "num_dataloader_workers",
}  # fmt: skip
# max_steps (extending a run): changing it continues the run, with a warning. The layout settings are not
# config keys: a checkpoint resumes on another layout.
_CONTINUABLE_KEYS = {"max_steps"}


class BackgroundWriter:
    """At most one checkpoint write in flight, on the main process's background thread.

    Only file work runs there (writing, fsync, checksums, publication, retention); every collective stays on
    the training thread. `wait` is called before the next save, before the run ends and before a preemption
    exit, so a run never finishes with a checkpoint half written, and a failed write is raised there.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: Any = None

    def snapshot(self, state: Any) -> Any:
        """A copy of `state` in host memory that training may not change, in the buffers of the last one.

        Reusing the buffers (once the last write is done) makes a snapshot a plain memory copy: allocating
        576 MB afresh for each save spent most of its time faulting in new pages. CUDA tensors are copied
        into pinned buffers without blocking, then synchronised once.
        """
        self.wait()
        self._staging = _host_copy(state, self._staging)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return self._staging

    def start(self, work: Callable[[], None]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._capture, args=(work,), name="accel-trainer-checkpoint")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint in the background failed: {error}") from error

    def _capture(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as error:  # re-raised on the training thread by wait()
            self._error = error


def save(
    accelerator: Accelerator, run_dir: Path, step: int, *, model: torch.nn.Module, optimizer: Any, scheduler: Any,
    recipe_name: str, cfg: TrainConfig, extra: dict[str, Any] | None = None,
    writer: BackgroundWriter | None = None, after_publish: Callable[[], None] | None = None,
) -> Path:  # fmt: skip
    """Write and publish the checkpoint of `step` (every process takes part); returns its folder.

    With a `writer`, the main process snapshots the full model and optimizer state in host memory and writes
    them, publishes and runs `after_publish` (retention) in the background, so training continues during
    the write. A sharded (FSDP) save is always synchronous: it needs collectives.
    """
    temporary = files.temporary_folder(run_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    problem = _agree(accelerator, _attempt(lambda: _prepare_folder(accelerator, temporary, writer)))
    if problem is None:
        model_state: Any
        model_state, optimizer_state = get_state_dict(model, optimizer.optimizer)
        heavy_writes: list[Callable[[], None]] = []

        def write_local_files() -> None:
            heavy_writes.extend(_write_tensors(accelerator, temporary, model_state, optimizer_state, writer))
            state_files.save(_rng_states(), temporary / rng_file_name(accelerator.process_index))
            if accelerator.is_main_process:
                _write_small_files(accelerator, temporary, step, scheduler, recipe_name, cfg, model_state, extra)

        problem = _agree(accelerator, _attempt(write_local_files))

    def finish() -> None:
        for write in heavy_writes:
            write()
        files.publish(temporary)
        if after_publish is not None:
            after_publish()

    # Decided alike on every process: a background write (the main process's only) needs no agreement now;
    # its failure is raised by writer.wait() at the next save, where the processes agree on it.
    in_background = writer is not None and accelerator.distributed_type != DistributedType.FSDP
    if problem is None and in_background:
        if accelerator.is_main_process:
            writer.start(finish)  # type: ignore[union-attr]
    elif problem is None:
        problem = _agree(accelerator, _attempt(finish) if accelerator.is_main_process else None)
    if problem is not None:
        newest = None
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)  # so that resume=auto never meets it
            newest = files.newest_valid_checkpoint(run_dir)
        raise CheckpointError(
            f"saving the checkpoint of step {step} in {files.checkpoints_dir(run_dir)} failed ({problem}); the run"
            f" stopped, its newest complete checkpoint {'is ' + newest.name if newest else 'is unchanged'}"
        )
    return files.final_folder(run_dir, step)


def _prepare_folder(accelerator: Accelerator, temporary: Path, writer: BackgroundWriter | None) -> None:
    """The main process waits for the last background write (raising its failure) and makes the folder."""
    if accelerator.is_main_process:
        if writer is not None:
            writer.wait()
        temporary.mkdir(parents=True)


def _write_tensors(
    accelerator: Accelerator, temporary: Path, model_state: Any, optimizer_state: Any,
    writer: BackgroundWriter | None,
) -> list[Callable[[], None]]:  # fmt: skip
    """Write the sharded tensors (FSDP, every process), or return the main process's writes of full ones."""
    if accelerator.distributed_type == DistributedType.FSDP:
        optimizer_skeleton, optimizer_tensors = state_files.split(optimizer_state, "optimizer")
        sharded = {**{MODEL_PREFIX + name: tensor for name, tensor in model_state.items()}, **optimizer_tensors}
        dcp.save(
            state_files.writable(sharded),
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
    accelerator: Accelerator, temporary: Path, step: int, scheduler: Any, recipe_name: str, cfg: TrainConfig,
    model_state: dict[str, Any], extra: dict[str, Any] | None,
) -> None:  # fmt: skip
    scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
    state_files.save({"scheduler": scheduler.state_dict(), "scaler": scaler}, temporary / TRAINER)
    state = {
        "format": FORMAT,
        "step": step,
        "samples_seen": step * cfg.global_batch_size,
        "recipe": recipe_name,
        "config_hash": config_hash(cfg),
        "world_size": accelerator.num_processes,
        "layout": {"distributed_type": accelerator.distributed_type.value,
                   "mixed_precision": accelerator.mixed_precision},
        "parameter_shapes": {name: list(t.shape) for name, t in model_state.items()},
        "config": config_to_dict(cfg),
        **(extra or {}),
    }  # fmt: skip
    (temporary / TRAIN_STATE).write_text(json.dumps(state, indent=1))
    (temporary / "config.yaml").write_text(config_to_yaml(cfg))


def restore(
    accelerator: Accelerator, folder: Path, *, model: torch.nn.Module, optimizer: Any, scheduler: Any,
    recipe_name: str, cfg: TrainConfig,
) -> tuple[dict[str, Any], dict[str, Any] | None]:  # fmt: skip
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
    model_state, optimizer_state = get_state_dict(model, optimizer.optimizer)
    try:  # the manifest proves integrity, not content: a folder written by someone else may not fit
        state = json.loads((folder / TRAIN_STATE).read_text())
        check_compatible(state, recipe_name, cfg, model_state, same_run=cfg.resume == "auto",
                         warn=accelerator.is_main_process)  # fmt: skip
        return _load(accelerator, folder, state, model, optimizer, scheduler, model_state, optimizer_state)
    except (OSError, SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {type(error).__name__}: {error}") from None


def _load(accelerator: Accelerator, folder: Path, state: dict[str, Any], model: Any, optimizer: Any, scheduler: Any,
          model_state: Any, optimizer_state: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:  # fmt: skip
    """Load model, optimizer, schedule, scaler and this process's RNG states from a checked checkpoint."""
    optimizer_skeleton = state_files.load_skeleton(folder / OPTIMIZER)
    if (folder / SHARDED).is_dir():
        optimizer_state = _load_sharded(folder, model_state, optimizer_state, optimizer_skeleton)
        options = None
    else:  # full tensors, which set_state_dict shards itself when this run is FSDP
        model_state = load_file(str(folder / "model.safetensors"))
        optimizer_state = state_files.load(folder / OPTIMIZER)
        options = StateDictOptions(full_state_dict=True)
    set_state_dict(model, optimizer.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=options)  # fmt: skip
    trainer = state_files.load(folder / TRAINER)
    scheduler.load_state_dict(trainer["scheduler"])
    if accelerator.scaler is not None and trainer["scaler"] is not None:
        accelerator.scaler.load_state_dict(trainer["scaler"])
    rng_file = folder / rng_file_name(accelerator.process_index)
    if state["world_size"] != accelerator.num_processes or not rng_file.is_file():
        if accelerator.is_main_process:
            warnings.warn(
                f"accel-trainer: resuming on {accelerator.num_processes} processes from a checkpoint of"
                f" {state['world_size']}: weights, optimizer and data order continue exactly, random streams"
                " (dropout, sampling) restart from the seed",
                stacklevel=2,
            )
        return state, None
    return state, state_files.load(rng_file)


def _load_sharded(folder: Path, model_state: dict[str, Any], optimizer_state: dict[str, Any],
                  optimizer_skeleton: Any) -> dict[str, Any]:  # fmt: skip
    """Load the sharded tensors in place into this run's (possibly sharded) state; returns the optimizer's."""
    _, live_optimizer_tensors = state_files.split(optimizer_state, "optimizer")
    saved_keys = state_files.tensor_keys(optimizer_skeleton)
    unknown = [key for key in saved_keys if key not in live_optimizer_tensors]
    if unknown:
        raise CheckpointError(
            f"checkpoint {folder}: its optimizer state does not fit this run's optimizer ({unknown[0]} has no"
            " counterpart here): was it written with another optimizer?"
        )
    targets = {MODEL_PREFIX + name: tensor for name, tensor in model_state.items()}
    targets.update({key: live_optimizer_tensors[key] for key in saved_keys})
    dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(folder / SHARDED)))
    return state_files.join(optimizer_skeleton, live_optimizer_tensors)


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
    foreign = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                     if p.is_file() and not p.name.endswith(SAFE_SUFFIXES))  # fmt: skip
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
    """
    if state["recipe"] != recipe_name:
        raise CheckpointError(f"the checkpoint was written by recipe {state['recipe']!r}, not {recipe_name!r}")
    changed = {
        key: (state["config"].get(key), value) for key, value in config_to_dict(cfg).items()
        if state["config"].get(key) != value and key not in _BOOKKEEPING_KEYS
    }  # fmt: skip
    listed = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())
    if same_run and set(changed) - _CONTINUABLE_KEYS:
        raise CheckpointError(
            f"the run in this output_dir was trained with another config ({listed}); resume=auto continues only"
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
        stretched = "; the LR schedule is stretched to the new max_steps from here" if "max_steps" in changed else ""
        warnings.warn(f"accel-trainer: config keys changed since the checkpoint: {listed}{stretched}", stacklevel=2)


def config_hash(cfg: TrainConfig) -> str:
    return hashlib.sha256(config_to_yaml(cfg).encode()).hexdigest()[:16]


def apply_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def rng_file_name(process_index: int) -> str:
    return f"rng_rank{process_index}.safetensors"


def _rng_states() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _host_copy(value: Any, into: Any = None) -> Any:
    """A copy in host memory of a (nested) state, written into `into`'s tensors where their shapes match."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if isinstance(into, torch.Tensor) and into.shape == value.shape and into.dtype == value.dtype:
            return into.copy_(value, non_blocking=value.is_cuda)
        if value.is_cuda:
            return torch.empty_like(value, device="cpu", pin_memory=True).copy_(value, non_blocking=True)
        return value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, dict):
        staged: dict = into if isinstance(into, dict) else {}
        return {key: _host_copy(item, staged.get(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        olds = list(into) if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        return type(value)(_host_copy(item, old) for item, old in zip(value, olds, strict=True))
    return copy.deepcopy(value)


def resume_point(accelerator: Accelerator, cfg: TrainConfig, run_dir: Path) -> Path | None:
    """The checkpoint folder `cfg.resume` names, decided on the main process and shared with the others.

    `auto` takes the newest complete checkpoint of the run folder (skipping incomplete or corrupt ones with a
    warning) or None; `none` is None; a path is a checkpoint folder (checked on load, so a broken one is a
    clear error) or a run folder, whose newest complete checkpoint is taken.
    """
    choice: list[str | None] = [None]
    if accelerator.is_main_process:
        files.remove_stale_temporaries(run_dir)
        if cfg.resume == "auto":
            found = files.newest_valid_checkpoint(run_dir)
            choice[0] = str(found) if found else None
        elif cfg.resume != "none":
            path = Path(cfg.resume)
            if files.checkpoints_dir(path).is_dir():
                found = files.newest_valid_checkpoint(path)
                choice[0] = str(found) if found else str(path)
            else:
                choice[0] = str(path)
    if accelerator.num_processes > 1:
        broadcast_object_list(choice)
    return Path(choice[0]) if choice[0] else None
