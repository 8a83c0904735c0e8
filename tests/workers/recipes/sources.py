"""One regression, trained from every kind of dataset a recipe may return (`source=`), for the data tests.

The same 100 examples come as a datasets.Dataset, a sharded datasets.IterableDataset (shuffled with a
buffer, so each epoch reshuffles), a datasets.IterableDataset from a generator, a torch map-style Dataset
and a torch IterableDataset; the torch sets give (x, y) tuples, so batches are tuples there. 100 is not a
multiple of the global batch of 16: each pass drops its 4-example tail.
"""

import os
import time
from dataclasses import dataclass
from typing import Literal

import datasets
import torch
import torch.nn.functional as F

import accel_trainer as at

NUM_EXAMPLES = 100


def table() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(NUM_EXAMPLES, 3, generator=generator)
    return {
        "x": x,
        "y": x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(NUM_EXAMPLES, 1, generator=generator),
    }


class TorchMap(torch.utils.data.Dataset):
    def __init__(self):
        self.data = table()

    def __len__(self):
        return NUM_EXAMPLES

    def __getitem__(self, index):
        return self.data["x"][index], self.data["y"][index]


class TorchStream(torch.utils.data.IterableDataset):
    """Yields the examples in an order that changes with the epoch (set_epoch)."""

    def __init__(self):
        self.data, self.epoch = table(), 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(NUM_EXAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch))
        for index in order.tolist():
            yield self.data["x"][index], self.data["y"][index]


def generate():
    data = table()
    for index in range(NUM_EXAMPLES):
        yield {"x": data["x"][index].tolist(), "y": data["y"][index].tolist()}


def log_build(event: str, path: str) -> None:
    with open(path, "a") as log:
        log.write(f"{event} {os.environ.get('RANK', '0')} {time.time()}\n")


def build(source: str, seed: int):
    hf = datasets.Dataset.from_dict({k: v.numpy() for k, v in table().items()})
    if source == "hf_map":
        return hf
    if source == "hf_sharded":
        return hf.to_iterable_dataset(num_shards=4).shuffle(seed=seed, buffer_size=32)
    if source == "hf_shards":  # in order: a split stream resumes from datasets' own state_dict
        return hf.to_iterable_dataset(num_shards=4)
    if source == "hf_generator":
        return datasets.IterableDataset.from_generator(generate)
    if source == "torch_map":
        return TorchMap()
    if source == "torch_stream":
        return TorchStream()
    if source == "list":
        return [{"x": x, "y": y} for x, y in zip(*table().values(), strict=True)]
    raise ValueError(source)


@dataclass
class SourcesConfig(at.TrainConfig):
    max_steps: int = 14
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 5e-2
    warmup_steps: int = 0
    log_every_steps: int = 1
    eval_every_steps: int = 7
    source: Literal["hf_map", "hf_sharded", "hf_shards", "hf_generator", "torch_map", "torch_stream", "list"] = "hf_map"
    """Which kind of dataset build_datasets returns."""
    build_log: str = ""
    """A file to which build_datasets appends when each process begins and ends it (rank and clock)."""


@at.register_recipe("sources")
class Sources(at.Recipe):
    """Linear regression from any kind of dataset."""

    Config = SourcesConfig

    def build_model(self, cfg):
        return torch.nn.Linear(3, 1)

    def build_datasets(self, cfg):
        if cfg.build_log:
            log_build("begin", cfg.build_log)
            time.sleep(1.0)  # long enough that an unordered start on another process would overlap
        sets = build(cfg.source, cfg.seed), build(cfg.source, cfg.seed)
        if cfg.build_log:
            log_build("end", cfg.build_log)
        return sets

    def compute_loss(self, model, batch):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        return F.mse_loss(model(x.float()), y.float())

    def eval_metrics(self, model, batch):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        return {"loss": (model(x.float()) - y.float()).pow(2).mean(dim=1)}
