"""Iterable training and eval sets: `datasets.IterableDataset` (streaming, sharded, `from_generator`,
`to_iterable_dataset`) and torch `IterableDataset`s, with the same guarantees as map-style sets.

A stream has no length, so training is bounded by `max_steps` and an epoch is one pass to the stream's end
(then `set_epoch(epoch + 1)`, which reshuffles a shuffled HF stream, and a new pass). Every process reads the
same stream in the same order and takes its own part of each global batch: process r's micro-batch k of a
step holds examples [(k * N + r) * m, (k * N + r + 1) * m) of that step's `global_batch_size` examples, the
same split the sharded map-style loader makes. So each example is trained on by exactly one process per
epoch, and 1 process and N processes follow the same trajectory at the same global batch. Reading the whole
stream on every process is what accelerate's `IterableDatasetShard` does too; splitting by shards instead
would make the order depend on the process count. The incomplete last global batch of a pass is dropped.

The position saved in a checkpoint is (epoch, examples read in it). Resuming re-reads and drops that many
examples of that epoch: exact whatever the stream, where `datasets`' own `state_dict()` loses the shuffle
buffer of a shuffled stream (its documentation says so) and would resume in another order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from accel_trainer.data.batching import BatchPlan
from accel_trainer.data.prefetch import Pass
from accel_trainer.errors import ConfigError


class TrainStream:
    """The micro-batches of one process over an iterable training set, from a saved position onwards."""

    def __init__(
        self,
        dataset: Any,
        collate: Callable,
        plan: BatchPlan,
        process_index: int,
        position: tuple[int, int] = (0, 0),
        ahead: Callable[[Pass], Pass] = lambda steps: steps,
    ) -> None:
        """`ahead`: the global batches of a pass as the training reads them (data/prefetch.py reads them ahead
        on a thread)."""
        self.dataset, self.collate, self.plan, self.process_index = dataset, collate, plan, process_index
        self.ahead = ahead
        self.position = position
        """(epoch, examples read in it) after the last global batch handed out: what a checkpoint saves."""

    def micro_batches(self, resume_rng: Callable[[], None] | None = None) -> Iterator[tuple[int, Any]]:
        """Yield `(epoch, micro_batch)` forever from the saved position.

        `resume_rng` restores the RNG states saved with that position at the moment the uninterrupted run had
        them: before the epoch's pass starts at an epoch boundary, right after the skipped examples otherwise.
        """
        plan, (epoch, skip) = self.plan, self.position
        while True:
            if skip == 0 and resume_rng is not None:
                resume_rng()
                resume_rng = None
            with contextlib.closing(self.ahead(self._global_batches(epoch, skip, resume_rng))) as batches:
                for read, window in batches:
                    self.position = (epoch, read)
                    for k in range(plan.accumulation_steps):
                        start = (k * plan.num_processes + self.process_index) * plan.micro_batch_size
                        yield epoch, self.collate(window[start : start + plan.micro_batch_size])
            epoch, skip, resume_rng = epoch + 1, 0, None

    def _global_batches(self, epoch: int, skip: int, resume_rng: Callable[[], None] | None) -> Pass:
        """A pass's global batches after its first `skip` examples, each with the examples read to its end
        (reading only: the step collates, so a collate drawing random numbers draws in the step's order)."""
        size = self.plan.global_batch_size
        window: list[Any] = []
        read = 0
        for example in examples(self.dataset, epoch):
            read += 1
            if read <= skip:
                if read == skip and resume_rng is not None:
                    resume_rng()
                continue
            window.append(example)
            if len(window) == size:
                yield read, window
                window = []
        if read < skip:
            raise ConfigError(
                f"the training stream gave {read} examples in epoch {epoch}, fewer than the {skip} read before"
                " the checkpoint: it changed since"
            )
        if read < size:
            raise ConfigError(
                f"the training stream gave {read} examples in epoch {epoch}, fewer than global_batch_size={size}"
            )


def eval_batches(
    dataset: Any, collate: Callable, micro_batch_size: int, process_index: int, num_processes: int
) -> Iterator[Any]:
    """This process's eval micro-batches: every num_processes-th example of one pass, none twice."""
    batch: list[Any] = []
    for index, example in enumerate(examples(dataset, 0)):
        if index % num_processes == process_index:
            batch.append(example)
            if len(batch) == micro_batch_size:
                yield collate(batch)
                batch = []
    if batch:
        yield collate(batch)


def examples(dataset: Any, epoch: int) -> Iterator[Any]:
    """One pass over a stream, told its epoch first when it can reshuffle (HF streams, torch sets that can)."""
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    return iter(dataset)


def whole_position(saved: Any) -> tuple[int, int]:
    """A checkpoint's (epoch, examples read) of a stream read whole; (0, 0) to start afresh.

    Raises:
        ConfigError: the position was saved reading the stream as readers (data/stream_split.py).
    """
    if saved is None:
        return 0, 0
    if isinstance(saved, dict):
        raise ConfigError(
            f"the checkpoint read the training stream as {len(saved.get('readers', []))} readers of its shards"
            " (stream_split=auto or shards) and this run reads it whole (stream_split=off, or a shard count that"
            " shares no divisor with global_batch_size: files added or removed?): resume with the stream_split,"
            " stream and global_batch_size it was trained with"
        )
    epoch, read = saved
    return epoch, read
