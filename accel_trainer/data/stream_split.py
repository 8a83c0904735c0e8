"""A sharded stream split over the data-parallel processes, so that each reads only its part (`stream_split`).

data/streams.py reads the whole stream on every process and keeps each process's share of every global batch:
the order of 1 process, on any number of them, at the cost of every process reading (and tokenizing) all of
it. Here a `datasets.IterableDataset` of several shards (files, or `to_iterable_dataset(num_shards=k)`) is split
by shards with `datasets.distributed.split_dataset_by_node`: process r reads shards r, r + N, ... of the epoch's
shard order (`set_epoch` may reorder the shards, as datasets 5.2 does from the third epoch even without a
`shuffle`), so N processes read N times faster. Each step every process takes
`accumulation_steps x micro_batch_size` examples of its own part; the global batch is theirs together. Every
example is read once an epoch; the epoch ends for all at the first step some process cannot fill (its part is
shorter), and what the others had left of it is dropped, as the incomplete last batch of a pass always is; where
that is more than a global batch (shards of unequal sizes) the run says so once. The order differs from 1
process's, so the trajectory does too: `stream_split=off` keeps the exact mode. With `num_prefetch_batches`, a
thread reads the process's steps ahead (data/prefetch.py): the processes meet at every step, and without it each
waits there for the slowest reader.

A checkpoint saves each process's position after its last step trained: its examples read in the epoch and
`datasets`' own `IterableDataset.state_dict()` taken as that step was read, from which a resume restarts reading
where the process was without re-reading (at most the rest of one shard's records, which `datasets` skips
unprocessed). A stream with a shuffle buffer
cannot resume exactly from its state (`datasets` drops the buffer's examples), so it re-reads its own part up to
its position: exact, and 1/N of what the whole stream would cost. Its position names the processes it was split
over: a resume on another number of data-parallel processes is refused in one line.
"""

from __future__ import annotations

import contextlib
import itertools
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


def splits(dataset: Any, setting: str, num_processes: int) -> bool:
    """Whether a training stream is read split by shards: `auto` when it can be, `shards` always (else a one-line
    error), `off` never; one process reads the whole stream either way.

    Raises:
        ConfigError: `shards` asked of a stream that cannot be split over these processes.
    """
    if setting == "off" or num_processes == 1:
        return False
    shards = dataset.num_shards if isinstance(dataset, datasets.IterableDataset) else 0
    if shards and shards % num_processes == 0:
        return True
    if setting == "shards":
        what = f"has {shards} shard(s)" if shards else "is not a datasets.IterableDataset: it has no shards"
        raise ConfigError(
            f"stream_split=shards: the training stream {what}, which do not split over {num_processes}"
            f" data-parallel processes; give it a multiple of {num_processes} shards (files, or"
            f" to_iterable_dataset(num_shards=...)), or set stream_split=auto to read it whole on every process"
        )
    return False


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
class _Step:
    """One step's examples of a process's part, read (fewer where the part ended), and the position after them."""

    examples: list[Any]
    read: int
    state: dict[str, Any] | None


class SplitStream:
    """The micro-batches of one data-parallel process over its own part of a sharded stream."""

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
        self.part = as_torch(split_dataset_by_node(dataset, rank=rank, world_size=plan.num_processes))
        self.collate, self.plan, self.rank, self.total, self.warn = collate, plan, rank, total, warn
        self.ahead = ahead
        self.exact_state = not has_shuffle_buffer(dataset)
        self.epoch, self.read, self.state = 0, 0, None
        self._warned = False

    def position(self) -> dict[str, Any]:
        """This process's position after the last step it handed out: epoch, examples read in it, and the
        stream's own state when a resume can start from it."""
        return {"epoch": self.epoch, "read": self.read, "state": self.state}

    def micro_batches(self, saved: dict[str, Any] | None, resume_rng: Callable[[], None] | None) -> Iterator[Any]:
        """Yield `(epoch, micro_batch)` forever from this process's `saved` position (None: the start).

        `resume_rng` restores the RNG states saved with that position when the uninterrupted run had them.
        """
        self.epoch, skip, state = (saved["epoch"], saved["read"], saved["state"]) if saved else (0, 0, None)
        while True:
            if skip == 0 and resume_rng is not None:  # at an epoch boundary: before the pass starts
                resume_rng()
                resume_rng = None
            if state is not None:
                self.part.load_state_dict(state)  # read from there on, for this epoch only
            reading = iter(examples(self.part, self.epoch))
            if state is None and skip and sum(1 for _ in itertools.islice(reading, skip)) < skip:
                raise ConfigError(
                    f"a process's part of the training stream gave fewer than the {skip} examples it read in epoch"
                    f" {self.epoch + 1} before the checkpoint: the stream changed since"
                )
            if resume_rng is not None:  # right after the examples read before the checkpoint
                resume_rng()
                resume_rng = None
            self.read, self.state = skip, state
            with contextlib.closing(self.ahead(self._steps(reading, skip))) as steps:
                for step in steps:
                    if not self._all_have(len(step.examples) == self._per_step):
                        self._count_dropped(len(step.examples) + sum(len(rest.examples) for rest in steps))
                        break
                    self.read, self.state = step.read, step.state
                    for start in range(0, self._per_step, self.plan.micro_batch_size):
                        yield self.epoch, self.collate(step.examples[start : start + self.plan.micro_batch_size])
            if self.read == 0:
                raise ConfigError(
                    f"a process's part of the training stream gave fewer than {self._per_step} examples in epoch"
                    f" {self.epoch + 1}, one step's worth: give the stream more examples or shards, or set"
                    " stream_split=off"
                )
            self.epoch, skip, state = self.epoch + 1, 0, None

    @property
    def _per_step(self) -> int:
        return self.plan.accumulation_steps * self.plan.micro_batch_size

    def _steps(self, reading: Iterator[Any], read: int) -> Pass:
        """The steps of the rest of a pass after `read` examples, ending with the one the part cannot fill
        (reading only: the step collates, so a collate drawing random numbers draws in the step's order)."""
        while len(window := list(itertools.islice(reading, self._per_step))) == self._per_step:
            read += self._per_step
            state = self.part.state_dict() if self.exact_state else None  # as of this step, however far ahead
            yield _Step(window, read, state)
        yield _Step(window, read, None)

    def _all_have(self, full: bool) -> bool:
        return self.total(int(full)) == self.plan.num_processes

    def _count_dropped(self, left: int) -> None:
        """Say (once) when an epoch's end left more than an incomplete global batch untrained: the processes'
        parts differ in size, so the longer ones are cut where the shortest ends (their rest is read to count)."""
        dropped = self.total(left)
        if dropped >= self.plan.global_batch_size and not self._warned:
            self._warned = True
            self.warn(
                f"accel-trainer: epoch {self.epoch + 1} of the split training stream ended where one process's part"
                f" did: {dropped} examples of the longer parts were not trained on (its shards differ in size;"
                " more, evener shards lose less, and stream_split=off reads every example)"
            )


def gathered(positions: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The stream position a checkpoint saves: each data-parallel rank's, from every process's (rank, position)
    (tensor- or pipeline-parallel peers of a rank read the same part)."""
    by_rank = dict(positions)
    return {"parts": [by_rank[rank] for rank in range(len(by_rank))]}


def position_for(saved: Any, rank: int, num_processes: int) -> dict[str, Any] | None:
    """This process's part of a checkpoint's stream position, or None to start afresh.

    Raises:
        ConfigError: the position was saved reading the stream whole, or split over another number of processes.
    """
    if saved is None:
        return None
    if not isinstance(saved, dict):
        raise ConfigError(
            "the checkpoint's stream position was saved reading the stream whole on every process (1 process,"
            " or stream_split=off); resume with stream_split=off"
        )
    if len(saved["parts"]) != num_processes:
        raise ConfigError(
            f"the checkpoint's stream was split over {len(saved['parts'])} data-parallel processes and this run"
            f" has {num_processes}: resume on {len(saved['parts'])}"
        )
    return saved["parts"][rank]
