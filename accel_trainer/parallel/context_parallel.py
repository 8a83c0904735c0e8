"""Context parallelism (CUDA only): the processes of a cp group each take a slice of every sequence.

accelerate builds the `cp` dimension of the mesh (parallel/mesh.py) and, in `prepare`, torch's `context_parallel`
context (`accelerator.maybe_context_parallel`). Inside it the batch tensors the recipe names in
`sequence_dims` are cut along their sequence dimension (load-balanced, so that causal attention costs each
process alike) and `F.scaled_dot_product_attention` becomes ring attention across the group. The loop runs
each training micro-batch's forward and backward inside it; FSDP shards over dp_shard x cp and averages the
gradients over both. Evaluation runs without it: each process the whole sequence.

What it asks of a recipe: `sequence_dims` naming every batch tensor read along the sequence (positions
included), a sequence length divisible by 2 x cp_size (the load balancer's chunks), attention through
`F.scaled_dot_product_attention`, and a token loss (`num_items`): each process sums the loss over its slice
and the exact normalisation counts the items of all slices, while the mean of a slice is not the mean of the
sequence. Each missing piece is a one-line error. torch has no CPU kernel for ring attention, so a CPU
layout with cp_size > 1 is refused (parallel/mesh.py); the CUDA test is in tests/layouts/test_gpu.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from accel_trainer.errors import ConfigError


@dataclass(frozen=True)
class SequenceSlicing:
    """A recipe's sequences as `cp` context-parallel processes slice them: what the step needs of the recipe, read
    once (its `sequence_dims`, and its name for the errors)."""

    cp: int
    dims: dict[str, int]
    recipe_name: str

    @classmethod
    def of(cls, recipe: Any, cp: int) -> SequenceSlicing:
        return cls(cp, dict(getattr(recipe, "sequence_dims", {}) or {}), type(recipe).__name__)

    def around(self, accelerator: Accelerator, batch: Any) -> Any:
        """The context in which a micro-batch's forward and backward run: its sequences sliced over the cp group
        (a no-op without context parallelism)."""
        if self.cp == 1:
            return contextlib.nullcontext()
        buffers, dims = self.buffers(batch)
        return accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=set(buffers)
        )

    def buffers(self, batch: Any) -> tuple[list[torch.Tensor], list[int]]:
        """The batch tensors to slice and their sequence dimensions, checked.

        Raises:
            ConfigError: no `sequence_dims`, a name the batch lacks, or a length the cp group cannot split evenly.
        """
        dims, name, cp = self.dims, self.recipe_name, self.cp
        if not dims:
            raise ConfigError(
                f"context parallelism slices sequences, but {name} has no sequence_dims: set sequence_dims ="
                ' {"input_ids": 1, ...} naming every batch tensor with a sequence dimension (positions included)'
            )
        if not isinstance(batch, dict) or any(not isinstance(batch.get(key), torch.Tensor) for key in dims):
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ConfigError(f"{name}.sequence_dims names {sorted(dims)}, but the batch holds {keys}")
        for key, dim in dims.items():
            if batch[key].shape[dim] % (2 * cp):
                raise ConfigError(
                    f"batch[{key!r}] has {batch[key].shape[dim]} positions, which {cp} context-parallel processes"
                    f" cannot split into 2 x {cp} equal chunks: pad sequences to a multiple of {2 * cp}"
                )
        return [batch[key] for key in dims], list(dims.values())

    def check_loss(self, num_items: Any) -> None:
        """A mean loss over a slice of each sequence is not the mean over the sequence: refuse it."""
        if self.cp > 1 and num_items is None:
            raise ConfigError(
                f"context parallelism needs {self.recipe_name}.compute_loss to return a token loss,"
                ' {"loss": sum, "num_items": count} (at.token_cross_entropy): a mean over each process\'s slice of'
                " the sequence is not the mean over the sequence"
            )


def sequence_slices(accelerator: Accelerator, recipe: Any, batch: Any, cp: int) -> Any:
    """`SequenceSlicing.around` for a recipe."""
    return SequenceSlicing.of(recipe, cp).around(accelerator, batch)


def sequence_buffers(recipe: Any, batch: Any, cp: int) -> tuple[list[torch.Tensor], list[int]]:
    """`SequenceSlicing.buffers` for a recipe."""
    return SequenceSlicing.of(recipe, cp).buffers(batch)


def check_loss_counts_items(num_items: Any, recipe: Any, cp: int) -> None:
    """`SequenceSlicing.check_loss` for a recipe."""
    SequenceSlicing.of(recipe, cp).check_loss(num_items)
