"""Checkpoint writes on a background thread, from a snapshot in host memory that training cannot change.

`async_save=true`: the main process snapshots the full model and optimizer state into reused host buffers
(pinned on CUDA), and the file work (writing, fsync, checksums, publication, retention) runs on a thread
while training continues. Every collective stays on the training thread. Measured blocking time: 7.4% of a
synchronous save (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch

from accel_trainer.checkpoint.files import CheckpointError


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
