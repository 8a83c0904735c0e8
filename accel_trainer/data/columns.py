"""The batched in-memory data path: a whole micro-batch read with one indexing of column tensors.

torch's DataLoader fetches a map-style set row by row (`dataset[i]` for each index, then `collate`), or, when
the set has `__getitems__`, with one call per batch. For a `datasets.Dataset` that one call reads the Arrow
rows together but still hands back a list of rows for `default_collate` to stack again: about 400 us a step
for a batch of 16 small rows, against a few microseconds for indexing the same data held as tensors (issue 11,
measured). So, where the recipe keeps the default `collate`, the set is a `datasets.Dataset` (torch format,
no custom transform) or a `TensorDataset`, and its columns fit `data_cache_gb`, the columns are read once into
tensors (`ColumnBatches`) whose `__getitems__` returns the collated batch itself, and the loader's collate
passes it through. The sampler, the sharding over processes, the permutation and the samples of every step
are the loader's as before, and the batch is bitwise the one `default_collate` would build (tested), so
trajectories and exact resume do not change. A custom `collate`, a transform, strings or ragged columns keep
the per-row path.
"""

from __future__ import annotations

from typing import Any

import datasets
import torch
from torch.utils.data import Dataset, TensorDataset

from accel_trainer.recipe import Recipe


class ColumnBatches(Dataset):
    """A map-style set whose columns are tensors in memory, read a batch of indices at a time."""

    def __init__(self, columns: dict[str, torch.Tensor] | list[torch.Tensor]) -> None:
        self.columns = columns
        tensors = list(columns.values()) if isinstance(columns, dict) else columns
        self.length = len(tensors[0])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if isinstance(self.columns, dict):
            return {name: column[index] for name, column in self.columns.items()}
        return tuple(column[index] for column in self.columns)

    def __getitems__(self, indices: list[int]) -> Any:
        """The batch of `indices`, as `default_collate` would build it from their rows (a list for tuples)."""
        index = torch.as_tensor(indices)
        if isinstance(self.columns, dict):
            return {name: column.index_select(0, index) for name, column in self.columns.items()}
        return [column.index_select(0, index) for column in self.columns]


def already_collated(batch: Any) -> Any:
    """The loader's collate for ColumnBatches, whose `__getitems__` returns the batch itself."""
    return batch


def column_batches(recipe: Recipe, dataset: Any, budget_gb: float) -> ColumnBatches | None:
    """The set as in-memory column tensors, or None where the per-row path must stay (see the module doc)."""
    if budget_gb <= 0 or type(recipe).collate is not Recipe.collate:
        return None
    if isinstance(dataset, TensorDataset):
        tensors = list(dataset.tensors)
        return ColumnBatches(tensors) if _bytes(tensors) <= budget_gb * 2**30 else None
    if not isinstance(dataset, datasets.Dataset) or dataset.format["type"] not in (None, "torch", "numpy"):
        return None  # a custom transform (set_transform) runs per row
    if dataset.data.nbytes > budget_gb * 2**30 or not len(dataset):
        return None
    columns = dataset.with_format("torch")[:]
    if not all(isinstance(column, torch.Tensor) and len(column) == len(dataset) for column in columns.values()):
        return None  # strings, or ragged lists that default_collate cannot stack either
    return ColumnBatches(columns)


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)
