"""A run's data, owned in one place: its sets, loaders or stream, batch plan and data ranks.

The loop asks it for the training micro-batches from a resume point (`micro_batches`) and for this process's eval
batches (`eval_batches`); the checkpointer, with which it is registered, for the stream position a checkpoint
carries (`state_dict`), and gives it back on resume (`load_state_dict`).
A map-style set's position is derived from the step; a stream's is the (epoch, examples read) it reached.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from accel_trainer.config.train_config import TrainConfig
from accel_trainer.data import loaders
from accel_trainer.data.batching import BatchPlan
from accel_trainer.data.prefetch import Pass, PrefetchGate, check_prefetching, prefetched
from accel_trainer.data.stream_split import SplitStream, described, gathered, position_for, reader_count, splits
from accel_trainer.data.streams import TrainStream, eval_batches, whole_position
from accel_trainer.errors import ConfigError
from accel_trainer.parallel.mesh import DataRanks
from accel_trainer.recipe import Recipe


@dataclass
class RunData:
    """The data one run trains and evaluates on, as this process reads it."""

    collate: Callable[[list[Any]], Any]
    plan: BatchPlan
    ranks: DataRanks  # the data-parallel dimension: what the data path and the item counts use
    train_set: Any
    train_loader: Any  # None for a stream (data/streams.py)
    eval_set: Any
    eval_loader: Any  # None for a stream, or without an eval set
    steps_per_epoch: int | None  # None for a stream: its epochs end where it does
    num_prefetch_batches: int = 0
    stream_split: str = "off"  # a sharded stream split over the processes (data/stream_split.py), or read whole
    prefetch_gate: PrefetchGate = field(default_factory=PrefetchGate)  # held shut while evaluating
    fingerprints: dict[str, str] = field(default_factory=dict)  # the recipe's `data_fingerprints`
    _stream: TrainStream | SplitStream | None = field(default=None, init=False)  # the stream, once reading began
    _position: list[int] | dict[str, Any] | None = field(default=None, init=False)  # a stream's, from a checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The data position a checkpoint carries (registered with the checkpointer): a stream's, None for a
        map-style set, whose position follows from the step; and the recipe's data fingerprints, if any."""
        fingerprints = {"data_fingerprints": dict(self.fingerprints)} if self.fingerprints else {}
        return {"data_position": self.stream_position(), **fingerprints}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A checkpoint's data position, refused in one line if this run cannot continue from it, as are data
        fingerprints that differ from this run's (a recipe's cache of precomputed values built from other inputs).

        Raises:
            ConfigError: the position or the fingerprints do not fit this run.
        """
        for name, recorded in saved.get("data_fingerprints", {}).items():
            if self.fingerprints.get(name) != recorded:
                here = self.fingerprints.get(name)
                raise ConfigError(
                    f"the checkpoint's data were built with {name} {recorded[:12]}, this run's with"
                    f" {here[:12] if here else 'none'}: resume with the settings, base and data it was trained"
                    " on, or start a new run"
                )
        position = saved.get("data_position")
        self.check_position(position)
        self._position = position

    def micro_batches(
        self, start_step: int, accelerator: Accelerator, resume_rng: Callable[[], None] | None
    ) -> Iterator[tuple[int, Any]]:
        """This process's training micro-batches after `start_step` optimizer steps (a stream: from the position
        its checkpoint saved), with the RNG states restored in time."""
        position = self._position
        if self.splits():
            total, warn = _total_over_ranks(accelerator, self.ranks), _warn_on_main(accelerator)
            split = SplitStream(
                self.train_set, loaders.as_torch, self.collate, self.plan, self.ranks.rank, total, warn, self._ahead
            )
            self._stream = split
            return split.micro_batches(position_for(position, self._readers()), resume_rng)
        if self.train_loader is None:
            start = whole_position(position)
            stream = TrainStream(loaders.as_torch(self.train_set), self.collate, self.plan, self.ranks.rank, start,
                                 self._ahead)  # fmt: skip
            self._stream = stream
            return stream.micro_batches(resume_rng)
        return loaders.micro_batches(
            self.train_loader,
            self.plan,
            self.steps_per_epoch or 0,
            start_step=start_step,
            skip_first_batches=accelerator.skip_first_batches,
            resume_rng=resume_rng,
            prefetch=self.num_prefetch_batches,
            gate=self.prefetch_gate,
            device=accelerator.device,
        )

    def _ahead(self, steps: Pass) -> Pass:
        """A stream pass's steps, read ahead on a thread with `num_prefetch_batches`: as many steps as hold that
        many micro-batches (data/prefetch.py)."""
        return prefetched(steps, None, self._steps_ahead(), self.prefetch_gate) if self.num_prefetch_batches else steps

    def _steps_ahead(self) -> int:
        return -(-self.num_prefetch_batches // self.plan.accumulation_steps)

    def check_position(self, position: list[int] | dict[str, Any] | None) -> None:
        """Refuse, in one line, a checkpoint's stream position that this run cannot continue from."""
        if self.splits():
            position_for(position, self._readers())
        elif self.train_loader is None:
            whole_position(position)

    def splits(self) -> bool:
        """Whether the training set is a stream read as logical readers (data/stream_split.py)."""
        return self.train_loader is None and splits(self.train_set, self.stream_split, self.plan)

    def _readers(self) -> int:
        return reader_count(self.train_set, self.plan.global_batch_size)

    def stream_position(self) -> list[int] | dict[str, Any] | None:
        """A stream's position for the checkpoint, None for a map-style set: (epoch, examples read), or each
        reader's when the stream is read as readers (a collective then: every process calls it)."""
        if isinstance(self._stream, SplitStream):
            return gathered(gather_object([self._stream.position()]))
        return None if self._stream is None else list(self._stream.position)

    def describe(self, recipe: Recipe) -> str:
        """How the training micro-batches are built, for the run's header."""
        if self.train_loader is not None:
            return loaders.describe_path(self.train_loader, recipe)
        when = (
            f"ahead on a thread, {self._steps_ahead()} step(s) at most" if self.num_prefetch_batches else "in the step"
        )
        if self.splits():
            return described(self.train_set, self.plan, self.ranks.rank, when)
        if self.stream_split == "auto":
            shards = getattr(self.train_set, "num_shards", 0)
            if self.ranks.size > 1 or shards > 1:
                why = (
                    f"its {shards} shards have no common divisor with global_batch_size={self.plan.global_batch_size}"
                    if shards > 1
                    else "it has no shards to read apart"
                )
                return f"a stream, read whole by every process {when} ({why}: 1 process's order on any number)"
        if self.ranks.size == 1:
            return f"a stream, read {when} (data/streams.py)"
        return f"a stream, read whole by every process {when} (data/streams.py)"

    def first_eval_examples(self) -> list[Any]:
        """The eval set's first micro-batch of examples, the same on every process (the sanity check before
        training)."""
        return loaders.first_examples(self.eval_set, self.plan.micro_batch_size)

    def eval_batches(self) -> tuple[Any, bool]:
        """This process's eval micro-batches, and whether they still hold the loader's padding duplicates."""
        if self.eval_loader is not None:
            return self.eval_loader, True
        batches = eval_batches(
            loaders.as_torch(self.eval_set), self.collate, self.plan.micro_batch_size, self.ranks.rank, self.ranks.size
        )
        return batches, False


def build_loaders(
    recipe: Recipe,
    cfg: TrainConfig,
    train_set: Any,
    eval_set: Any,
    plan: BatchPlan,
    ranks: DataRanks,
    accelerator: Accelerator,
) -> tuple[Any, Any]:
    """The training and eval loaders (before `accelerator.prepare`); None for a stream, which data/streams.py
    reads instead, and None for eval on tensor- or context-parallel ranks (`RunData.eval_batches`)."""
    workers = cfg.num_dataloader_workers
    if workers and loaders.is_stream(train_set) and accelerator.is_main_process:
        warnings.warn(
            "accel-trainer: num_dataloader_workers has no effect on a stream: it is read in the training"
            " process (data/streams.py)",
            stacklevel=3,
        )
    options = dict(num_workers=workers, cache_gb=cfg.data_cache_gb, pin_memory=accelerator.device.type == "cuda")
    train_loader = None if loaders.is_stream(train_set) else loaders.train_loader(recipe, train_set, plan, **options)
    if cfg.num_prefetch_batches:
        check_prefetching(
            recipe, loaders.as_torch(train_set), train_loader, plan.micro_batch_size, warn=accelerator.is_main_process
        )
    eval_loader = None  # tensor-parallel ranks share batches: their eval goes the disjoint way (RunData.eval_batches)
    if eval_set is not None and not loaders.is_stream(eval_set) and ranks.replicas == ranks.context_parallel == 1:
        eval_loader = loaders.eval_loader(recipe, eval_set, plan, **options)
    return train_loader, eval_loader


def _total_over_ranks(accelerator: Accelerator, ranks: DataRanks) -> Callable[[int], int]:
    """The sum of a count over the data-parallel ranks: over every process, each rank's peers (tensor, pipeline,
    context parallel) counting alike."""

    def total(count: int) -> int:
        summed = accelerator.reduce(torch.tensor(count, device=accelerator.device), reduction="sum")
        return int(summed) // (ranks.replicas * ranks.context_parallel)

    return total


def _warn_on_main(accelerator: Accelerator) -> Callable[[str], None]:
    def warn(line: str) -> None:
        if accelerator.is_main_process:
            warnings.warn(line, stacklevel=2)

    return warn
