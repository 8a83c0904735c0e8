"""A regressor with dropout on rows collated by its own `collate` (the per-row path), for prefetching tests.

Forty rows make five optimizer steps of eight per epoch, so a run of a few dozen steps crosses several epoch
boundaries; dropout draws from torch's global generator in every forward pass, beside whatever builds the
batches. `random_collate` makes the collate draw from it too; `failing_read` makes one row read fail. `stream`
gives the rows as a stream instead (datasets' `IterableDataset` of 4 shards, or a torch one that draws a
per-row noise from the global generator as it reads: `random_stream`).
"""

from dataclasses import dataclass
from typing import Literal

import datasets
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

import accel_trainer as at


@dataclass
class RowsConfig(at.TrainConfig):
    max_steps: int = 23
    global_batch_size: int = 8
    micro_batch_size: int = 4
    lr: float = 1e-2
    warmup_steps: int = 0
    log_every_steps: int = 1
    eval_every_steps: int = 0
    random_collate: bool = False
    """Add noise drawn from torch's global generator to every batch."""
    failing_read: int = 0
    """Raise at this row read, counting reads from 1 (row 4k+1 to 4k+4 make micro-batch k); 0: none."""
    stream: Literal["", "datasets", "random_stream"] = ""
    """Give the rows as a stream: a datasets.IterableDataset of 4 shards, or a torch one drawing as it reads."""


class Rows(torch.utils.data.Dataset):
    def __init__(self, failing_read: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.failing_read, self.reads = torch.randn(40, 5, generator=generator), failing_read, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        if self.reads == self.failing_read:
            raise ValueError(f"read {self.reads} failed")
        return {"x": self.x[index], "y": self.x[index].sum(0, keepdim=True)}


class RandomStream(torch.utils.data.IterableDataset):
    """The rows in order, each with a noise drawn from torch's global generator as it is read."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows

    def __iter__(self):
        for index in range(len(self.rows)):
            row = self.rows[index]
            yield {"x": row["x"] + 0.01 * torch.randn(5), "y": row["y"]}


@at.register_recipe("rows_with_dropout")
class RowsWithDropout(at.Recipe):
    Config = RowsConfig

    def build_model(self, cfg):
        return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                   torch.nn.Linear(16, 1))  # fmt: skip

    def build_datasets(self, cfg):
        rows = Rows(cfg.failing_read)
        if cfg.stream == "datasets":
            table = datasets.Dataset.from_dict({"x": rows.x.numpy(), "y": rows.x.sum(1, keepdim=True).numpy()})
            return table.to_iterable_dataset(num_shards=4), None
        if cfg.stream == "random_stream":
            return RandomStream(rows), None
        return rows, None

    def collate(self, examples):
        batch = default_collate(examples)
        if self.cfg.random_collate:
            batch["x"] = batch["x"] + 0.01 * torch.randn_like(batch["x"])
        return batch

    def compute_loss(self, model, batch):
        return F.mse_loss(model(batch["x"]), batch["y"])
