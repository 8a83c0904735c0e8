"""Building the next micro-batches on a background thread while the step runs (`num_prefetch_batches`).

Reading rows and collating them is Python work beside a step whose matrix work releases the GIL, so a thread
can build the next batches while the model computes (the wide-MLP row-by-row case of benchmarks/prefetch.py:
about 5% more steps/s on 2 cores). torch's own background loading, `num_dataloader_workers`, pays for it with
a copy of every batch between processes, which measured no gain there; on a sub-millisecond step a thread
costs more in GIL hand-overs than it saves, hence off by default.

A thread must not change what the run computes. What in a loader's epoch could:
- Creating the loader's iterator draws its base seed from torch's global generator, and accelerate registers
  the loader as the active one (`GradientState`) then and drops it at the epoch's end. So the first fetches of
  each epoch (which create the iterator) and its last (which ends it) are made in the training thread, at the
  moments they are made without prefetching; the thread makes only the ones between. (accelerate's loader
  builds one batch ahead, so the last batch itself is built on the thread; ending the epoch is not.)
- A collate or transform drawing from a global generator would draw at moments that interleave with the step's
  own draws (dropout) differently on every run. The CHECKED_FETCHES fetches after the first, in the training
  thread, compare torch's (and CUDA's), numpy's and Python's generator states around each: a draw there is a
  one-line error before any thread starts. A draw only some batches make, or a generator the recipe keeps
  itself, cannot be seen this way: the setting's documentation asks for batch building that draws nothing.
- Evaluation may share the data objects (a tokenizer, a file) and forks its loader's workers: the loop pauses
  the thread's fetching while it evaluates (`PrefetchGate.paused`), so the two never run at once.
An exception in the thread is raised in the training thread when it reaches that batch, as without a thread.
Up to `depth` + 2 micro-batches are built ahead (the queue, the one in hand, accelerate's look-ahead), on the
device on GPUs. `check_prefetching` makes these refusals before any work, on the set's first micro-batches.

A stream (data/streams.py, data/stream_split.py) is read ahead the same way, a step's examples at a time with the
position they end at, so that a checkpoint saves where the training is, not where the reading got to. Each epoch's
pass starts (and its first steps are checked) in the training thread; the epoch's length is not known, so the
thread reads until the pass ends. On split streams it pays most: each process reads at its own pace instead of
waiting at every step for the slowest (benchmarks/stream_split.py).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import warnings
from collections.abc import Generator, Iterator
from typing import Any

import torch

from accel_trainer.data.columns import ColumnBatches
from accel_trainer.data.rng import capture_rng_states, rng_untouched
from accel_trainer.errors import ConfigError

CHECKED_FETCHES = 2

Pass = Generator[Any, None, None]
"""A stream's steps in one pass, as read; closing it stops a thread reading ahead."""

_END = object()


class _Failure:
    """An exception raised by the thread's fetch, handed over to be raised in the training thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class PrefetchGate:
    """Lets the loop hold the prefetch thread's fetching while it evaluates."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._fetching = threading.Lock()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No fetch runs inside this block (one in progress is waited for)."""
        self._open.clear()
        try:
            with self._fetching:
                yield
        finally:
            self._open.set()

    def fetch(self, batches: Iterator[Any], stop: threading.Event) -> Any:
        """The next item, once the gate is open; `_END` if `stop` was set while waiting."""
        while not self._open.wait(timeout=0.05):
            if stop.is_set():
                return _END
        with self._fetching:
            return next(batches)


def prefetched(
    batches: Iterator[Any],
    total: int | None,
    depth: int,
    gate: PrefetchGate | None = None,
    device: torch.device | None = None,
) -> Generator[Any, None, None]:
    """The `total` items of `batches` (one loader epoch), those between the first few and the last fetched ahead
    by a thread, at most `depth` of them waiting; `total=None` (a stream's pass): every item after the first few,
    to the end.

    Raises:
        ConfigError: building a batch drew from a global random generator.
    """
    fetched = 0
    with contextlib.suppress(StopIteration):  # an epoch shorter than its length said ends here, as it would inline
        inline = 1 + CHECKED_FETCHES if total is None else min(total, 1 + CHECKED_FETCHES)
        while fetched < inline:
            item = next(batches) if fetched == 0 else _checked_fetch(batches)
            yield item
            fetched += 1
        ahead = None if total is None else total - 1 - fetched  # the last one stays in this thread
        if ahead is None or ahead > 0:
            yield from _from_thread(batches, ahead, depth, gate or PrefetchGate(), device)
    yield from batches  # the last item, and the end of the epoch


def _checked_fetch(batches: Iterator[Any]) -> Any:
    """The next item, refused if fetching it moved a global random generator."""
    before = _global_generator_states()
    item = next(batches)
    if _global_generator_states() != before:
        raise ConfigError(
            "num_prefetch_batches: building a training batch draws from a global random generator (torch, numpy or"
            " random), which a background thread would make irreproducible: set num_prefetch_batches=0, or draw in"
            " the dataset (its __getitem__, a stream's __iter__) from a generator seeded by the row,"
            " torch.Generator().manual_seed(seed + index)"
        )
    return item


def _global_generator_states() -> tuple[Any, ...]:
    """Every global random stream (`capture_rng_states`: Python, numpy, torch, CUDA), comparable with ==."""
    states = capture_rng_states()
    numpy_state = states["numpy"]  # (name, key array, position, cached Gaussian flag, its value)
    cuda = [bytes(state.numpy()) for state in states["cuda"] or []]
    return (bytes(states["torch"].numpy()), *cuda, states["python"], numpy_state[1].tobytes(), *numpy_state[2:])


def _from_thread(
    batches: Iterator[Any], count: int | None, depth: int, gate: PrefetchGate, device: torch.device | None
) -> Iterator[Any]:
    """`count` items of `batches` (None: all), fetched by a thread into a queue of `depth`; the thread stops when
    this generator is closed (the run ended) or raised through."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    # The thread's pinning and copies go to this process's GPU, not to GPU 0. A one-GPU run's device is a bare
    # `cuda`, which set_device refuses: the index is the training thread's current device.
    gpu = None
    if device is not None and device.type == "cuda":
        gpu = device.index if device.index is not None else torch.cuda.current_device()

    def fetch() -> None:
        try:
            if gpu is not None:
                torch.cuda.set_device(gpu)
            for _ in itertools.repeat(None) if count is None else range(count):
                item = gate.fetch(batches, stop)
                if item is _END or not _put(ready, item, stop):
                    return
        except StopIteration:  # the epoch ended before its length said: the caller's loop sees the end
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


def check_prefetching(recipe: Any, rows: Any, train_loader: Any, micro_batch_size: int, warn: bool) -> None:
    """Before any work: refuse batch building that draws random numbers (the first micro-batches of `rows`, the
    training set in torch format, built once with every random stream restored after), and warn where a thread
    cannot pay. A stream (`train_loader` None) is checked as it is read, on each pass's first steps.

    Raises:
        ConfigError: a draw from a global generator while building a batch.
    """
    depth = recipe.cfg.num_prefetch_batches
    if train_loader is None:
        return
    if isinstance(train_loader.dataset, ColumnBatches):  # default collate, no transform: nothing draws
        if warn:
            warnings.warn(
                f"accel-trainer: num_prefetch_batches={depth} on the batched column path, where a micro-batch is one"
                " indexing (microseconds): a thread's hand-overs cost more than they save (docs/benchmarks.md); it"
                " pays on the row-by-row path beside a compute-bound step",
                stacklevel=4,
            )
        return
    with rng_untouched(), contextlib.suppress(StopIteration):  # a set of fewer rows: what there is
        first_batches = _first_batches(recipe, rows, micro_batch_size)
        for _ in range(CHECKED_FETCHES):
            _checked_fetch(first_batches)


def _first_batches(recipe: Any, rows: Any, micro_batch_size: int) -> Iterator[Any]:
    """The first CHECKED_FETCHES micro-batches of the set in its order, each read row by row and collated."""
    for start in range(0, min(len(rows), CHECKED_FETCHES * micro_batch_size), micro_batch_size):
        yield recipe.collate([rows[index] for index in range(start, min(start + micro_batch_size, len(rows)))])
