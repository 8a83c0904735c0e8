"""Data loaders over map-style sets (`datasets.Dataset`, torch `Dataset`), and the micro-batches the loop consumes.

Iterable sets (streams) have their own path in data/streams.py; `check_dataset` refuses anything else.

Training loaders shuffle with accelerate's seedable sampler and drop the last incomplete micro-batch; the
micro-batch stream then hands each optimizer step exactly one global batch, skipping the incomplete tail of
an epoch, so that the data of step k is the same on 1 process or N (the sharded loader gives process r the
micro-batches r, r+N, r+2N, ... of the one global order).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import datasets
import torch.utils.data
from torch.utils.data import DataLoader

from accel_trainer.data.batching import BatchPlan
from accel_trainer.data.columns import ColumnBatches, already_collated, column_batches
from accel_trainer.data.prefetch import PrefetchGate, prefetched
from accel_trainer.errors import RecipeError
from accel_trainer.recipe import Recipe

ACCEPTED = (
    "a datasets.Dataset or datasets.IterableDataset (streaming, to_iterable_dataset, from_generator), or a"
    " torch.utils.data.Dataset (with __len__) or torch.utils.data.IterableDataset"
)


def is_stream(dataset: Any) -> bool:
    """Whether a set is iterable-only (no length, no random access): it takes the data/streams.py path."""
    return isinstance(dataset, (datasets.IterableDataset, torch.utils.data.IterableDataset))


def check_dataset(dataset: Any, role: str) -> None:
    """Refuse what build_datasets may not return (a list, a generator object, ...) with one line.

    Raises:
        RecipeError: naming what was returned and what is accepted.
    """
    if is_stream(dataset) or isinstance(dataset, datasets.Dataset):
        return
    if isinstance(dataset, torch.utils.data.Dataset) and hasattr(dataset, "__len__"):
        return
    raise RecipeError(f"build_datasets returned a {type(dataset).__name__} as the {role} set; return {ACCEPTED}")


def as_torch(dataset: Any) -> Any:
    """An HF dataset formatted to return tensors, as `datasets` does for PyTorch (one with a transform of its
    own, `set_transform`, as it is: the transform makes its rows); a torch set as it is."""
    if isinstance(dataset, datasets.Dataset) and dataset.format["type"] == "custom":
        return dataset
    if isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        return dataset.with_format("torch")
    return dataset


def first_examples(dataset: Any, count: int) -> list[Any]:
    """The first `count` examples of a set in torch format (as_torch), a map-style set's or a stream's: what a
    probe or a trace runs on before training."""
    examples = as_torch(dataset)
    if is_stream(dataset):
        return list(itertools.islice(iter(examples), count))
    return [examples[i] for i in range(min(count, len(examples)))]


def describe_path(train_loader: Any, recipe: Recipe) -> str:
    """How the training micro-batches are built, for the run's header (the speeds differ by 5x on small models)."""
    cfg = recipe.cfg
    if isinstance(train_loader.dataset, ColumnBatches):
        how = "columns held in memory, one indexing per micro-batch"
    elif cfg.data_cache_gb <= 0:
        how = "row by row (data_cache_gb=0)"
    elif type(recipe).collate is not Recipe.collate:
        how = "row by row through the recipe's collate"
    else:
        how = "row by row (a transform, strings, ragged columns, or more than data_cache_gb)"
    extras = [f"{cfg.num_dataloader_workers} worker process(es)"] * bool(cfg.num_dataloader_workers)
    extras += [f"{cfg.num_prefetch_batches} prefetched on a thread"] * bool(cfg.num_prefetch_batches)
    return how + "".join(f", {extra}" for extra in extras)


def train_loader(
    recipe: Recipe, dataset: Any, plan: BatchPlan, num_workers: int, cache_gb: float, pin_memory: bool = False
) -> DataLoader:
    """The training loader; `pin_memory` (for a CUDA device) lets accelerate copy each batch without blocking."""
    source, collate = _source(recipe, dataset, cache_gb)
    return DataLoader(
        source,
        batch_size=plan.micro_batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


def eval_loader(
    recipe: Recipe, dataset: Any, plan: BatchPlan, num_workers: int, cache_gb: float, pin_memory: bool = False
) -> DataLoader:
    source, collate = _source(recipe, dataset, cache_gb)
    return DataLoader(
        source,
        batch_size=plan.micro_batch_size,
        shuffle=False,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


def _source(recipe: Recipe, dataset: Any, cache_gb: float) -> tuple[Any, Callable[[Any], Any]]:
    """The set a loader reads and its collate: in-memory columns read a batch at a time where they can be
    (data/columns.py), else the rows and the recipe's collate."""
    batched = column_batches(recipe, dataset, cache_gb)
    return (batched, already_collated) if batched is not None else (as_torch(dataset), recipe.collate)


def micro_batches(
    loader: Any,
    plan: BatchPlan,
    steps_per_epoch: int,
    *,
    start_step: int = 0,
    skip_first_batches: Callable[[Any, int], Any] | None = None,
    resume_rng: Callable[[], None] | None = None,
    prefetch: int = 0,
    gate: PrefetchGate | None = None,
    device: torch.device | None = None,
) -> Iterator[tuple[int, Any]]:
    """Yield `(epoch, micro_batch)` forever, `steps_per_epoch * accumulation_steps` micro-batches an epoch.

    Each epoch calls `set_epoch` first (the permutation depends on seed and epoch only) and runs the loader
    to its end, so accelerate's end-of-loader bookkeeping stays consistent; the few micro-batches past the
    last complete global batch are read and dropped.

    Resuming after `start_step` optimizer steps skips the micro-batches this process already consumed in
    that epoch (`skip_first_batches` reads no skipped data) and calls `resume_rng` to restore the saved RNG
    states when the uninterrupted run had them: creating a loader iterator draws from the global RNG, which
    the uninterrupted run did mid-epoch only at the epoch's start, so mid-epoch the states are restored
    *after* the first fetch, while at an epoch boundary they are restored before it (docs/accelerate-traps.md).

    `prefetch` > 0 builds up to that many micro-batches ahead on a thread (data/prefetch.py), the same ones; `gate`
    lets the loop pause it.
    """
    per_epoch = steps_per_epoch * plan.accumulation_steps
    epoch, steps_done = divmod(start_step, steps_per_epoch)
    skip = steps_done * plan.accumulation_steps
    if resume_rng is not None and skip == 0:
        resume_rng()
        resume_rng = None
    while True:
        loader.set_epoch(epoch)
        source = skip_first_batches(loader, skip) if skip and skip_first_batches else loader
        fetched = prefetched(iter(source), len(source), prefetch, gate, device) if prefetch else source
        for index, batch in enumerate(fetched, start=skip):
            if resume_rng is not None:
                resume_rng()
                resume_rng = None
            if index < per_epoch:
                yield epoch, batch
        skip = 0
        epoch += 1
