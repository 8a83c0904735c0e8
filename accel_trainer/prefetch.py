"""Building the next micro-batches on a background thread while the step runs (`num_prefetch_batches`).

Reading rows and collating them is Python work beside a step whose matrix work releases the GIL, so a thread
can build the next batches while the model computes (the wide-MLP row-by-row case of benchmarks/prefetch.py:
about 9% more steps/s on 2 cores). torch's own background loading, `num_dataloader_workers`, pays for it with
a copy of every batch between processes, which measured no gain there; on a sub-millisecond step a thread
costs more in GIL hand-overs than it saves, hence off by default.

A thread must not change what the run computes, and two things in a loader's epoch would:
- The loader's iterator draws its base seed from torch's global generator when it is created, and accelerate
  registers it as the active loader (`GradientState`) then and drops it at the epoch's end. So each epoch's
  first micro-batch and its last are fetched in the calling thread, where they are without prefetching; the
  thread fetches only the ones between.
- A collate or transform that draws from a global generator (torch's, numpy's, Python's) would draw at moments
  that interleave with the step's own draws (dropout) differently on every run. The first CHECKED_FETCHES
  fetches after the first are made in the calling thread with the three generators' states compared around
  each; a draw is a one-line error naming the fix, before any thread starts.
An exception in the thread is raised in the training thread when it reaches that batch, as without a thread.
Streams are read in the step (streams.py keeps their position batch by batch) and refuse the setting.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .errors import ConfigError

CHECKED_FETCHES = 2

_END = object()


class _Failure:
    """An exception raised by the thread's fetch, handed over to be raised in the training thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetched(batches: Iterator[Any], total: int, depth: int, device: torch.device | None = None) -> Iterator[Any]:
    """The `total` items of `batches` (one loader epoch), those between the first few and the last built ahead
    by a thread, at most `depth` of them waiting.

    Raises:
        ConfigError: building a batch drew from a global random generator.
    """
    fetched = 0
    while fetched < min(total, 1 + CHECKED_FETCHES):
        yield next(batches) if fetched == 0 else _checked_fetch(batches)
        fetched += 1
    ahead = total - 1 - fetched  # the last one stays in this thread
    if ahead > 0:
        yield from _from_thread(batches, ahead, depth, device)
    yield from batches  # the last item, and the end of the epoch


def _checked_fetch(batches: Iterator[Any]) -> Any:
    """The next item, refused if fetching it moved a global random generator."""
    before = _global_generator_states()
    item = next(batches)
    if _global_generator_states() != before:
        raise ConfigError(
            "num_prefetch_batches: building a training batch draws from a global random generator (torch, numpy or"
            " random), which a background thread would make irreproducible: set num_prefetch_batches=0, or draw"
            " from a generator seeded from the sample (e.g. torch.Generator().manual_seed(seed + index))"
        )
    return item


def _global_generator_states() -> tuple[bytes, Any, bytes, int]:
    """torch's, Python's and numpy's global generator states, comparable with ==."""
    numpy_state: Any = np.random.get_state()  # (name, key array, position, ...)
    return bytes(torch.random.get_rng_state().numpy()), random.getstate(), numpy_state[1].tobytes(), numpy_state[2]


def _from_thread(batches: Iterator[Any], count: int, depth: int, device: torch.device | None) -> Iterator[Any]:
    """`count` items of `batches`, fetched by a thread into a queue of `depth`; the thread stops when this
    generator is closed (the run ended) or raised through."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def fetch() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)  # pinning and copies on this process's GPU, not on GPU 0
        try:
            for _ in range(count):
                if not _put(ready, next(batches), stop):
                    return
        except StopIteration:  # shorter than its length said: the rest of the epoch goes on in the caller
            pass
        except BaseException as error:  # noqa: BLE001 - raised again in the training thread
            _put(ready, _Failure(error), stop)
            return
        _put(ready, _END, stop)

    thread = threading.Thread(target=fetch, name="accel-trainer-prefetch", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()


def _put(ready: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put `item` once there is room; False if the consumer went away first."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def refuse_on_stream(num_prefetch_batches: int) -> None:
    """Raises: ConfigError: prefetching asked for a stream."""
    if num_prefetch_batches:
        raise ConfigError(
            "num_prefetch_batches works on map-style training sets; this recipe's training set is a stream"
            " (an IterableDataset), read in the step so that its position is exact: set num_prefetch_batches=0"
        )
