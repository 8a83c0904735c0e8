"""Data loaders over `datasets.Dataset`, and the stream of micro-batches the loop consumes.

Training loaders shuffle with accelerate's seedable sampler and drop the last incomplete micro-batch; the
micro-batch stream then hands each optimizer step exactly one global batch, skipping the incomplete tail of
an epoch, so that the data of step k is the same on 1 process or N (the sharded loader gives process r the
micro-batches r, r+N, r+2N, ... of the one global order).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from .batching import BatchPlan
from .recipe import Recipe


def as_torch(dataset: Any) -> Any:
    """The dataset formatted to return tensors, as `datasets` does for PyTorch."""
    return dataset.with_format("torch")


def train_loader(recipe: Recipe, dataset: Any, plan: BatchPlan, num_workers: int) -> DataLoader:
    return DataLoader(
        as_torch(dataset),
        batch_size=plan.micro_batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=recipe.collate,
        num_workers=num_workers,
    )


def eval_loader(recipe: Recipe, dataset: Any, plan: BatchPlan, num_workers: int) -> DataLoader:
    return DataLoader(
        as_torch(dataset),
        batch_size=plan.micro_batch_size,
        shuffle=False,
        collate_fn=recipe.collate,
        num_workers=num_workers,
    )


def micro_batches(
    loader: Any, plan: BatchPlan, steps_per_epoch: int, start_epoch: int = 0
) -> Iterator[tuple[int, Any]]:
    """Yield `(epoch, micro_batch)` forever, `steps_per_epoch * accumulation_steps` micro-batches an epoch.

    Each epoch calls `set_epoch` first (the permutation depends on seed and epoch only) and runs the loader
    to its end, so accelerate's end-of-loader bookkeeping stays consistent; the few micro-batches past the
    last complete global batch are read and dropped.
    """
    per_epoch = steps_per_epoch * plan.accumulation_steps
    epoch = start_epoch
    while True:
        loader.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index < per_epoch:
                yield epoch, batch
        epoch += 1
