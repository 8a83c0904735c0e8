"""Checkpoint writes on a background thread, from a snapshot in host memory that training cannot change.

`async_save=true`, on every layout:
- Full weights (1 process, DDP): the main process snapshots the model and optimizer state into reused host
  buffers (pinned on CUDA), and the file work (writing, fsync, checksums, publication, retention) runs on a
  thread while training continues. Measured blocking time: 7.4% of a synchronous save (docs/benchmarks.md).
- Sharded (FSDP, HSDP, tensor or pipeline parallel): on the CPU, every process copies its shards into host
  buffers kept from one save to the next (host_shards.py) and its thread runs `dcp.save` of the copies; on CUDA,
  torch's `dcp.async_save` stages them in pinned memory on a stream of its own, overlapping the next forward and
  backward (the optimizer step waits for it), and writes them on its own thread; the main process's thread then
  publishes. DCP's collectives (planning, and the coordinator learning that every rank has written, which is
  what makes publishing safe) run on a gloo group of their own: on the training's group they would interleave
  with the step's collectives from another thread. The CUDA stager is kept from one save to the next, so its
  pinned buffers are reused (`async_save` closes a stager it creates itself after each save).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from concurrent import futures
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from accel_trainer.checkpoint import state_files
from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.checkpoint.host_shards import HostShards


class BackgroundWriter:
    """At most one checkpoint write in flight per process, on a background thread.

    Only file work runs there (writing, fsync, checksums, publication, retention), and a sharded save's DCP
    collectives, on a gloo group of their own; every collective of training stays on the training thread.
    `wait` is called before the next save, before the run ends and before a preemption exit, so a run never
    finishes with a checkpoint half written, and a failed write is raised there.
    """

    def __init__(self, collective_timeout_s: float = 1800.0) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: Any = None
        self._timeout = timedelta(seconds=collective_timeout_s)
        self._group: Any = None  # DCP's gloo group, made at the first sharded save (every process saves then)
        self._stager: DefaultStager | None = None  # on CUDA
        self._host_shards = HostShards()  # on the CPU
        self._label: Any = None  # what the write in flight is of (its step), and when it started
        self._started = self._ended = self._ended_at = 0.0
        self._copying: Any = None  # the sharded save's copy to host memory, while it runs
        self._staging_waited_s = 0.0
        self.finished: list[dict[str, Any]] = []
        """The background writes the training thread has waited for since it last looked: step, seconds the
        write took, when it ended (Unix time), seconds training waited for it (for its copy to host memory before
        an optimizer step, and for the write at the next save or the run's end)."""

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

    def sharded_save(self, tensors: dict[str, Any], storage: HuggingFaceStorageWriter) -> Callable[[], None]:
        """Copy this process's shards to host memory; returns their write (run on the writer's thread), which
        raises its failure and returns, on the main process, once every rank has written.

        On the CPU the copy is made here, into the buffers of the last save (host_shards.py), and the whole
        `dcp.save` runs in the background: `dcp.async_save` would still spend 0.06 s of the training thread on
        its per-tensor logging (1,041 tensors). A copy on a background thread would compete with the step for
        the same cores (measured: 0.29 s of waiting before the next optimizer step against 0.07 s for the copy
        itself, 2 processes on 2 cores). On CUDA, DCP's stager copies to pinned memory on a stream of its own,
        overlapping the next step's forward and backward, which read the weights and optimizer state but do not
        change them; `wait_for_staging`, before the optimizer step, holds the step until it is done. Buffers,
        which a forward may change (BatchNorm's statistics), must be copies already.
        """
        self.wait()  # the host buffers are those of the last write
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
            if torch.cuda.is_available():
                self._stager = DefaultStager(StagingOptions(True, False, True, True))
        if self._stager is None:
            staged, group = self._host_shards.copy(tensors), self._group

            def write() -> None:
                dcp.save(staged, storage_writer=storage, process_group=group)

            return write
        saving = dcp.async_save(
            state_files.writable(tensors), storage_writer=storage, process_group=self._group, async_stager=self._stager
        )
        if isinstance(saving, AsyncSaveResponse):
            self._copying, self._staging_waited_s, saving = saving.staging_completion, 0.0, saving.upload_completion
        return lambda: saving.result()

    def wait_for_staging(self) -> None:
        """Return once the last sharded save's copy to host memory is done: the weights may change after it."""
        if self._copying is not None:
            waiting = time.perf_counter()
            futures.wait([self._copying])  # a failure is the upload's too, raised by wait()
            self._copying, self._staging_waited_s = None, time.perf_counter() - waiting

    def start(self, work: Callable[[], None], label: Any = None) -> None:
        self.wait()
        self._label, self._started = label, time.perf_counter()
        self._thread = threading.Thread(target=self._capture, args=(work,), name="accel-trainer-checkpoint")
        self._thread.start()

    def wait(self) -> None:
        self.wait_for_staging()
        if self._thread is not None:
            waiting = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.finished.append(
                {
                    "step": self._label,
                    "write_s": self._ended - self._started,
                    "written_at": self._ended_at,  # the event's own time is when training next looked
                    "waited_s": time.perf_counter() - waiting + self._staging_waited_s,
                }
            )
            self._staging_waited_s = 0.0
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint in the background failed: {error}") from error

    def close(self) -> None:
        """Wait for the write in flight, then free the stager's host buffers."""
        try:
            self.wait()
        finally:
            self._host_shards = HostShards()
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _capture(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as error:  # re-raised on the training thread by wait()
            self._error = error
        finally:
            self._ended, self._ended_at = time.perf_counter(), time.time()


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
