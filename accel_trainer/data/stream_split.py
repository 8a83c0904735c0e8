"""A sharded stream read as logical readers, so that any number of processes trains the same batches while
each reads only part of it (`stream_split`).

data/streams.py reads the whole stream on every process: 1 process's order on any number of them, at the cost
of every process reading (and tokenizing) all of it. Splitting the shards by process instead (torchtitan's and
Megatron's way) makes the order depend on the process count. Here the k shards of a `datasets.IterableDataset`
(files, or `to_iterable_dataset(num_shards=k)`) are read as r logical **readers**, r = gcd(k,
global_batch_size): reader j is `split_dataset_by_node(dataset, rank=j, world_size=r)` (its k/r shards, its own
shuffle buffer, its own `state_dict()`), a function of the data and the global batch alone. Every global batch
is the next global_batch_size / r examples of each reader, readers in order; process p of N trains the p-th
of its N equal slices and reads only the readers that slice spans: r/N of them where N divides r, and where it
does not, the readers at a slice's edges are read by both processes sharing them. So 1, 2 or 4 processes train
the same global batches, hence the same trajectory, and every example is read once an epoch by the processes
together (where N divides r). The epoch ends at the first step some reader cannot fill its share (readers of
unequal sizes: what the others had left is dropped, as the incomplete last batch of a pass always is, and the run
says so once where that is more than a global batch).

A checkpoint saves each reader's position after the last step trained (examples read in the epoch, and
`datasets`' own state as that step was read), written by the process whose slice starts in it. A resume on any
number of processes restarts each reader there without re-reading (at most the rest of one shard's records,
which `datasets` skips unprocessed); a reader with a shuffle buffer, whose content that state lacks, re-reads its
own examples up to its position instead. With `num_prefetch_batches` a thread reads a process's steps ahead
(data/prefetch.py).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import datasets
from datasets.distributed import split_dataset_by_node
from datasets.iterable_dataset import BufferShuffledExamplesIterable

from accel_trainer.data.batching import BatchPlan
from accel_trainer.data.prefetch import Pass
from accel_trainer.data.streams import examples
from accel_trainer.errors import ConfigError


def reader_count(dataset: Any, global_batch_size: int) -> int:
    """The stream's logical readers: the most that divide both its shards and the global batch (0: no shards)."""
    shards = dataset.num_shards if isinstance(dataset, datasets.IterableDataset) else 0
    return math.gcd(shards, global_batch_size) if shards else 0


def splits(dataset: Any, setting: str, plan: BatchPlan) -> bool:
    """Whether a training stream is read as logical readers: `auto` when it has two or more (on any number of
    processes, 1 included: the order is the readers'), `shards` also only where every process reads its own
    readers alone (else a one-line error), `off` never.

    Raises:
        ConfigError: `shards` asked of a stream that cannot be read so on these processes.
    """
    if setting == "off":
        return False
    readers = reader_count(dataset, plan.global_batch_size)
    if setting == "auto":
        return readers >= 2
    if readers >= 2 and readers % plan.num_processes == 0:
        return True
    if not readers:
        why = "is not a datasets.IterableDataset: it has no shards"
    else:
        why = (
            f"has {dataset.num_shards} shard(s), so {readers} reader(s) (their greatest common divisor with"
            f" global_batch_size={plan.global_batch_size})"
        )
    wanted = max(2, plan.num_processes)
    raise ConfigError(
        f"stream_split=shards: the training stream {why}, which do not split over {plan.num_processes} data-parallel"
        f" process(es); give it a shard count whose greatest common divisor with global_batch_size is a multiple of"
        f" {wanted} (files, or to_iterable_dataset(num_shards=...)), or set stream_split=auto: each process then"
        " reads the readers its share of a step spans (neighbours share an edge one), and one reader is read whole"
    )


def has_shuffle_buffer(dataset: datasets.IterableDataset) -> bool:
    """Whether a stream shuffles through a buffer, whose content `datasets`' state_dict() does not hold.

    `datasets` has no public way to ask: this walks its (private) chain of example iterables, in one place.
    """
    pending = [dataset._ex_iterable]
    while pending:
        node = pending.pop()
        if isinstance(node, BufferShuffledExamplesIterable):
            return True
        inner = [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", [])]
        pending += [n for n in inner if n is not None]
    return False


@dataclass(frozen=True)
class Readers:
    """Which readers one data-parallel process reads, and where its slice of a global batch lies in theirs."""

    count: int
    per_step: int  # examples of each reader in a global batch
    slice_size: int  # examples of each process in a global batch
    rank: int

    @classmethod
    def of(cls, count: int, plan: BatchPlan, rank: int) -> Readers:
        return cls(count, plan.global_batch_size // count, plan.global_batch_size // plan.num_processes, rank)

    def spanned(self) -> range:
        """The readers this process's slice spans, in order."""
        start = self.rank * self.slice_size
        return range(start // self.per_step, (start + self.slice_size - 1) // self.per_step + 1)

    def owns(self, reader: int) -> bool:
        """Whether this process saves `reader`'s position and counts what it drops: the one whose slice holds
        the reader's first example of a step."""
        return reader * self.per_step // self.slice_size == self.rank

    def cut(self, windows: list[list[Any]]) -> list[Any]:
        """This process's slice of a step, from the windows of the readers it spans."""
        offset = self.rank * self.slice_size - self.spanned().start * self.per_step
        return list(itertools.chain.from_iterable(windows))[offset : offset + self.slice_size]


@dataclass(frozen=True)
class _Step:
    """One step read from a process's readers: its slice, whether every reader filled its share, the position of
    each owned reader after it, and the examples of owned readers it holds (with the rest of a pass at its end)."""

    examples: list[Any]
    full: bool
    positions: dict[int, dict[str, Any]]
    owned: int


class SplitStream:
    """The micro-batches of one data-parallel process over the readers its slices span."""

    def __init__(
        self,
        dataset: datasets.IterableDataset,
        as_torch: Callable[[Any], Any],
        collate: Callable,
        plan: BatchPlan,
        rank: int,
        total: Callable[[int], int],
        warn: Callable[[str], None] = lambda line: None,
        ahead: Callable[[Pass], Pass] = lambda steps: steps,
    ) -> None:
        """`total(n)`: the sum of `n` over the data-parallel processes (a collective); `warn`: say a line once;
        `ahead`: the steps of a pass as the training reads them (data/prefetch.py reads them ahead on a thread)."""
        count = reader_count(dataset, plan.global_batch_size)
        self.readers = Readers.of(count, plan, rank)
        self.parts = {
            j: as_torch(split_dataset_by_node(dataset, rank=j, world_size=count)) for j in self.readers.spanned()
        }
        self.collate, self.plan, self.total, self.warn, self.ahead = collate, plan, total, warn, ahead
        self.exact_state = not has_shuffle_buffer(dataset)
        self.epoch, self.positions = 0, {j: _start() for j in self.parts if self.readers.owns(j)}
        self._warned = False

    def position(self) -> dict[str, Any]:
        """The epoch and this process's owned readers' positions after the last step it handed out."""
        return {"epoch": self.epoch, "readers": dict(self.positions)}

    def micro_batches(self, saved: dict[str, Any] | None, resume_rng: Callable[[], None] | None) -> Iterator[Any]:
        """Yield `(epoch, micro_batch)` forever from a checkpoint's `saved` position (None: the start).

        `resume_rng` restores the RNG states saved with that position when the uninterrupted run had them.
        """
        self.epoch = saved["epoch"] if saved else 0
        starts = {j: saved["readers"][j] if saved else _start() for j in self.parts}
        while True:
            if resume_rng is not None and not any(start["read"] for start in starts.values()):
                resume_rng()  # at an epoch boundary: before the pass starts
                resume_rng = None
            readings = {j: self._reading(j, start) for j, start in starts.items()}
            if resume_rng is not None:  # right after the examples read before the checkpoint
                resume_rng()
                resume_rng = None
            self.positions = {j: start for j, start in starts.items() if self.readers.owns(j)}
            trained = False
            with contextlib.closing(self.ahead(self._steps(readings, starts))) as steps:
                for step in steps:
                    if self.total(int(step.full)) != self.plan.num_processes:
                        self._count_dropped(step.owned + sum(rest.owned for rest in steps))
                        break
                    self.positions, trained = step.positions, True
                    for start in range(0, len(step.examples), self.plan.micro_batch_size):
                        yield self.epoch, self.collate(step.examples[start : start + self.plan.micro_batch_size])
            if not trained and not any(start["read"] for start in starts.values()):
                raise ConfigError(
                    f"a reader of the training stream gave fewer than {self.readers.per_step} examples in epoch"
                    f" {self.epoch + 1}, its share of one global batch: give the stream more examples or shards,"
                    " or set stream_split=off"
                )
            self.epoch, starts = self.epoch + 1, {j: _start() for j in self.parts}

    def _reading(self, reader: int, start: dict[str, Any]) -> Iterator[Any]:
        """Reader `reader`'s examples of this epoch from its saved start."""
        part = self.parts[reader]
        if start["state"] is not None:
            part.load_state_dict(start["state"])  # read from there on, for this epoch only
        reading = iter(examples(part, self.epoch))
        skip = 0 if start["state"] is not None else start["read"]
        if skip and sum(1 for _ in itertools.islice(reading, skip)) < skip:
            raise ConfigError(
                f"reader {reader} of the training stream gave fewer than the {skip} examples it read in epoch"
                f" {self.epoch + 1} before the checkpoint: the stream changed since"
            )
        return reading

    def _steps(self, readings: dict[int, Iterator[Any]], starts: dict[int, dict[str, Any]]) -> Pass:
        """The steps of the rest of a pass, ending with one that some reader cannot fill (reading only: the step
        collates, so a collate drawing random numbers draws in the step's order)."""
        read = {j: start["read"] for j, start in starts.items()}
        owned = [j for j in readings if self.readers.owns(j)]
        while True:
            windows = {j: list(itertools.islice(reading, self.readers.per_step)) for j, reading in readings.items()}
            if any(len(window) < self.readers.per_step for window in windows.values()):
                left = sum(len(windows[j]) + sum(1 for _ in readings[j]) for j in owned)
                yield _Step([], False, {}, left)
                return
            positions = {}
            for j in owned:
                read[j] += self.readers.per_step
                state = self.parts[j].state_dict() if self.exact_state else None  # as of this step
                positions[j] = {"read": read[j], "state": state}
            yield _Step(self.readers.cut(list(windows.values())), True, positions, len(owned) * self.readers.per_step)

    def _count_dropped(self, left: int) -> None:
        """Say (once) when an epoch's end left more than an incomplete global batch untrained: the readers differ
        in size, so the longer ones are cut where the shortest ends (their rest is read to count)."""
        dropped = self.total(left)
        if dropped >= self.plan.global_batch_size and not self._warned:
            self._warned = True
            self.warn(
                f"accel-trainer: epoch {self.epoch + 1} of the split training stream ended where its shortest reader"
                f" did: {dropped} examples of the longer ones were not trained on (its shards differ in size;"
                " more, evener shards lose less, and stream_split=off reads every example)"
            )


def described(dataset: datasets.IterableDataset, plan: BatchPlan, rank: int, when: str) -> str:
    """The header's data line for a stream read as readers: how many, and which rule decides what a process reads."""
    count, processes = reader_count(dataset, plan.global_batch_size), plan.num_processes
    if processes == 1:
        share = "one process reads them all"
    elif count % processes == 0:
        share = f"each process reads {count // processes} of them"
    else:
        spanned = len(Readers.of(count, plan, rank).spanned())
        share = f"each process reads those its share of a step spans ({spanned} here, the edge ones shared)"
    return (
        f"a stream of {dataset.num_shards} shards read as {count} readers, {plan.global_batch_size // count} examples"
        f" of each a step, the same batches on any number of processes: {share}, {when}"
    )


def _start() -> dict[str, Any]:
    return {"read": 0, "state": None}


def gathered(positions: list[dict[str, Any]]) -> dict[str, Any]:
    """The stream position a checkpoint saves, from every process's: the epoch and each reader's position
    (tensor- or pipeline-parallel peers of a rank report the same readers)."""
    readers: dict[int, Any] = {}
    for position in positions:
        readers.update(position["readers"])
    return {"epoch": positions[0]["epoch"], "readers": [readers[j] for j in range(len(readers))]}


def position_for(saved: Any, readers: int) -> dict[str, Any] | None:
    """A checkpoint's stream position for a run reading the stream as `readers` readers, or None to start afresh.

    Raises:
        ConfigError: the position was saved reading the stream whole, or as other readers.
    """
    if saved is None:
        return None
    if not isinstance(saved, dict):
        raise ConfigError(
            "the checkpoint's stream position was saved reading the stream whole on every process"
            " (stream_split=off, or shards that did not split); resume with stream_split=off"
        )
    if "parts" in saved:
        raise ConfigError(
            f"the checkpoint's stream was split by an earlier accel-trainer over {len(saved['parts'])} processes:"
            f" resume it on {len(saved['parts'])} with that version"
        )
    if len(saved["readers"]) != readers:
        raise ConfigError(
            f"the checkpoint read the training stream as {len(saved['readers'])} readers and this run as {readers}"
            " (the greatest common divisor of its shards and global_batch_size): resume with the stream and"
            " global_batch_size it was trained with"
        )
    return {"epoch": saved["epoch"], "readers": {j: part for j, part in enumerate(saved["readers"])}}
