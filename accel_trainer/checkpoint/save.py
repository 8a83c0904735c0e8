"""What a checkpoint holds, and saving it on any layout (checkpoint/restore.py loads it).

A checkpoint folder (`checkpoints/step_00000120/`) holds no pickle, so loading one cannot run code:
    model.safetensors                  full weights (1 process or DDP), or
    distributed/                       per-rank safetensors shards of model and optimizer (FSDP, tensor or
                                       pipeline parallel), written and resharded on load by
                                       torch.distributed.checkpoint's HF storage
    optimizer.safetensors              the optimizer state (checkpoint/state_files.py: tensors, JSON structure); under
                                       FSDP only its structure, the tensors being in distributed/
    trainer.safetensors                LR scheduler and fp16 gradient-scaler state
                                       (only the trainable weights where some are frozen: checkpoint/frozen.py)
    ema.safetensors                    the EMA of the weights (optim/ema.py), with `ema_decay`; under FSDP or tensor
                                       parallelism its shards are `ema/` keys of distributed/ instead
    rng_rank<r>.safetensors            every process's RNG states (python, numpy, torch, cuda)
    rollout_rank<r>.safetensors        a checkpoint inside a rollout's generation: each process's micro-batches
                                       of it still to train on (checkpoint/generations.py)
    train_state.json                   format, step, epoch, samples seen, recipe, config and its hash, world
                                       size, layout, parameter shapes; the data position is derived from the step
    config.yaml, manifest.json         the resolved config; sizes and checksums, written last

Model and optimizer go through torch's layout-independent state-dict API (`get_state_dict` /
`set_state_dict`, keyed by parameter names without DDP, FSDP or checkpoint-wrapper prefixes), and a sharded
checkpoint is resharded on load, so a checkpoint written on one layout resumes on another: FSDP to 1 process
or DDP and back, a pipeline to 1 process and back (checkpoint/pipeline_state.py). accelerate's `save_state` is not used
because its non-FSDP files cannot be loaded into FSDP, it pickles (torch.save, and DCP's default format
pickles its metadata), and it restores RNG states at the wrong moment for an exact mid-epoch resume
(docs/accelerate-traps.md). A checkpoint of the earlier pickle
format, or one holding any file accel-trainer does not write, is refused with one line.
"""

from __future__ import annotations

import copy
import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import gather_object
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import get_state_dict

from accel_trainer.checkpoint import files, state_files
from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.checkpoint.pipeline_state import merge_optimizer_skeletons
from accel_trainer.checkpoint.small_files import small_files
from accel_trainer.checkpoint.trained import RunIdentity, Trained
from accel_trainer.checkpoint.writer import BackgroundWriter
from accel_trainer.data.rng import capture_rng_states, rng_file_name
from accel_trainer.parallel.sharding import is_sharded, local_part

SHARDED = "distributed"
OPTIMIZER = "optimizer.safetensors"
MODEL_PREFIX = "model/"  # keys of the model's tensors among the sharded files' (the optimizer's: "optimizer/")
EMA_PREFIX = "ema/"  # and of the EMA's
EMA = "ema.safetensors"


def save(
    accelerator: Accelerator,
    run_dir: Path,
    recorded: dict[str, Any],
    trained: Trained,
    identity: RunIdentity,
    *,
    writer: BackgroundWriter | None = None,
    after_publish: Callable[[], None] | None = None,
) -> Path:
    """Write and publish the checkpoint of step `recorded["step"]` (every process takes part), `recorded` being
    the run's registered states (checkpoint/train_state.py); returns its folder.

        With a `writer`, the tensors are snapshot in host memory (the main process's full state, or every
        process's shards through DCP's async save) and written in the background; the main process then publishes
        and runs `after_publish` (retention) there too, so training continues during the write.
    """
    step, sharded = recorded["step"], is_sharded(accelerator, trained.model)
    temporary = files.temporary_folder(run_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    problem = _agree(accelerator, _attempt(lambda: _prepare_folder(accelerator, temporary, writer)))
    heavy_writes: list[Callable[[], None]] = []  # what the main process still has to write (in the background)
    if problem is None:
        states = get_state_dict(trained.model, trained.optimizers.torch_optimizers())  # a collective when sharded
        write = functools.partial(_write_files, accelerator, temporary, recorded, trained, identity, writer, sharded)
        problem = _agree(accelerator, _attempt(lambda: heavy_writes.extend(write(*states))))

    def finish() -> None:
        for write in heavy_writes:  # on the main process of a sharded save, the last returns once all have written
            write()
        if accelerator.is_main_process:
            files.publish(temporary)
            if after_publish is not None:
                after_publish()

    # Decided alike on every process: a background write needs no agreement now; its failure is raised by
    # writer.wait() at the next save, where the processes agree on it.
    if problem is None and writer is not None:
        writer.start(finish, label=step)
    elif problem is None:
        problem = _agree(accelerator, _attempt(finish) if accelerator.is_main_process else None)
    if problem is not None:
        _stop_after_failed_save(accelerator, run_dir, temporary, step, problem)
    return files.final_folder(run_dir, step)


def _write_files(
    accelerator: Accelerator,
    temporary: Path,
    recorded: dict[str, Any],
    trained: Trained,
    identity: RunIdentity,
    writer: BackgroundWriter | None,
    sharded: bool,
    model_state: Any,
    optimizer_state: Any,
) -> list[Callable[[], None]]:
    """This process's files of the checkpoint: its tensors (or their snapshot, for a background writer, whose
    writes are returned), its RNG states and, on the main process, the small files (in the background too: the
    main process publishes after them, where another process's file must be written before it returns)."""
    saved = model_state if trained.frozen is None else trained.frozen.trainable_part(model_state)
    heavy_writes = _write_tensors(
        accelerator,
        temporary,
        _buffers_copied(saved, trained.model) if writer is not None and sharded else saved,
        optimizer_state,
        writer,
        sharded,
        pipeline=trained.whole is not None,
        ema=trained.ema.average if trained.ema else {},
    )
    rng = functools.partial(
        state_files.save, capture_rng_states(), temporary / rng_file_name(accelerator.process_index)
    )
    if trained.generations is not None:  # small, and replaced at the next generation: written now
        trained.generations.save(temporary, accelerator.process_index, recorded["step"])
    if not accelerator.is_main_process:
        rng()
        return heavy_writes
    small: list[Callable[[], None]] = [
        rng,
        *small_files(accelerator, temporary, recorded, trained, identity, model_state),
    ]
    if writer is None:
        for write in small:
            write()
        small = []
    return [*small, *heavy_writes]


def _buffers_copied(model_state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """The state with its buffers copied now: the next forward may change them (BatchNorm's statistics) while
    a sharded background save is still copying the rest (BackgroundWriter.sharded_save)."""
    buffers = {local_part(buffer).data_ptr() for buffer in model.buffers()}
    return {name: t.clone() if local_part(t).data_ptr() in buffers else t for name, t in model_state.items()}


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
    """Every process waits for its last background write (raising its failure); the main one makes the folder."""
    if writer is not None:
        writer.wait()
    if accelerator.is_main_process:
        temporary.mkdir(parents=True)


def _write_tensors(
    accelerator: Accelerator,
    temporary: Path,
    model_state: Any,
    optimizer_state: Any,
    writer: BackgroundWriter | None,
    sharded: bool,
    pipeline: bool = False,
    ema: dict[str, torch.Tensor] | None = None,
) -> list[Callable[[], None]]:
    """Write the sharded tensors (every process), or return the main process's writes of full ones."""
    ema = ema or {}
    if sharded:
        optimizer_skeleton, optimizer_tensors = state_files.split(optimizer_state, "optimizer")
        if pipeline:  # each process holds the optimizer state of its own stages
            optimizer_skeleton = merge_optimizer_skeletons(gather_object([optimizer_skeleton]))
        tensors = {
            **{MODEL_PREFIX + name: tensor for name, tensor in model_state.items()},
            **optimizer_tensors,
            **{EMA_PREFIX + name: tensor for name, tensor in ema.items()},
        }
        storage = HuggingFaceStorageWriter(str(temporary / SHARDED), save_distributed=True)
        skeleton = copy.deepcopy(optimizer_skeleton)  # the LRs in it change at the next step
        main_writes: list[Callable[[], None]] = []
        if accelerator.is_main_process:
            main_writes.append(functools.partial(state_files.save_skeleton, skeleton, temporary / OPTIMIZER))
        if writer is not None:
            return [*main_writes, writer.sharded_save(tensors, storage)]
        dcp.save(state_files.writable(tensors), storage_writer=storage)
        for write in main_writes:
            write()
        return []
    if not accelerator.is_main_process:
        return []
    if writer is not None:
        staged = writer.snapshot({"model": model_state, "optimizer": optimizer_state, "ema": ema})
        weights, optimizer_copy, average = staged["model"], staged["optimizer"], staged["ema"]
    else:
        weights, optimizer_copy, average = state_files.writable(model_state), optimizer_state, state_files.writable(ema)
    writes: list[Callable[[], None]] = [
        functools.partial(save_file, weights, str(temporary / "model.safetensors")),
        functools.partial(state_files.save, optimizer_copy, temporary / OPTIMIZER, "optimizer"),
    ]
    if ema:
        writes.append(functools.partial(save_file, average, str(temporary / EMA)))
    return writes


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
