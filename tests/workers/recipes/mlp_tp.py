"""An MLP classifier for the mesh and pipeline tests: a mean loss, and a module its tp_plan leaves alone.

LayerNorm -> Linear (colwise) -> GELU -> Linear (rowwise): the LayerNorm gets replicated DTensor parameters
(parallel/tensor_parallel.py), so the tests cover the leftover path beside the GPT's sequence-parallel plan. On a
pipeline layout its pipeline_split puts the last Linear alone on the second stage.
"""

from dataclasses import dataclass

import datasets
import torch
import torch.nn.functional as F
from torch import nn

import accel_trainer as at


def classification_data(num_samples: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 8, generator=generator)
    labels = (x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).argmax(dim=1)
    return {"x": x, "label": labels}


@dataclass
class MlpConfig(at.TrainConfig):
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 1e-2
    hidden: int = 32


@at.register_recipe("mlp_tp")
class TensorParallelMlp(at.Recipe):
    """A 4-class MLP with a tensor-parallel plan."""

    Config = MlpConfig
    tp_plan = {"1": "colwise", "3": "rowwise"}
    pipeline_split = ("3",)

    def build_model(self, cfg):
        return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, 4))

    def build_datasets(self, cfg):
        train, evaluation = classification_data(256, seed=1), classification_data(64, seed=2)
        as_dataset = lambda columns: datasets.Dataset.from_dict({k: v.numpy() for k, v in columns.items()})  # noqa: E731
        return as_dataset(train).with_format("torch"), as_dataset(evaluation).with_format("torch")

    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["label"])
