"""The rows of a batch, whatever shape `collate` gave it: how many samples it holds, and its first few.

Evaluation cuts the last batch of a loader that accelerate evened out with duplicates down to its real rows
(engine/evaluator.py), and a pipeline's last stage computes the loss of each slice of a micro-batch
(parallel/pipeline/stages.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def batch_size(batch: Any) -> int:
    """The number of samples of a batch: its first tensor's first dimension (a dict, tuple or list of them, or
    a tensor), else the length of its first entry (a column of strings, say)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.ndim > 0]
    if leaves:
        return int(leaves[0].shape[0])
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return len(first)


def first_rows(batch: Any, rows: int) -> Any:
    """The batch cut to its first `rows` samples (select_rows)."""
    return select_rows(batch, torch.arange(rows), batch_size(batch))


def select_rows(batch: Any, index: torch.Tensor, size: int) -> Any:
    """The rows `index` of every tensor in `batch` whose first dimension is the batch's `size`, and of every
    list of that length holding no tensor (a column of strings); anything else is kept whole."""
    if isinstance(batch, torch.Tensor):
        return batch[index.to(batch.device)] if batch.ndim and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        return {key: select_rows(value, index, size) for key, value in batch.items()}
    if isinstance(batch, list) and len(batch) == size and not any(isinstance(v, torch.Tensor) for v in batch):
        return [batch[i] for i in index.tolist()]
    if isinstance(batch, (tuple, list)):
        return type(batch)(select_rows(value, index, size) for value in batch)
    return batch
