"""A classifier with BatchNorm, whose running statistics differ from process to process during training."""

from dataclasses import dataclass

import datasets
import torch
import torch.nn.functional as F

import accel_trainer as at


def bn_data(num_samples: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 5.0, num_samples).unsqueeze(1)  # samples of very different magnitudes
    x = torch.randn(num_samples, 6, generator=generator) * scale + 1.0
    return {"x": x, "label": (x[:, 0] > x[:, 1]).long()}


@dataclass
class BNConfig(at.TrainConfig):
    max_steps: int = 12
    global_batch_size: int = 16
    micro_batch_size: int = 8
    lr: float = 1e-2
    eval_every_steps: int = 6
    log_every_steps: int = 6
    warmup_steps: int = 0


@at.register_recipe("batchnorm")
class BatchNormClassifier(at.Recipe):
    """MLP with BatchNorm1d on data whose batches have very different statistics."""

    Config = BNConfig

    def build_model(self, cfg):
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 2))  # fmt: skip

    def build_datasets(self, cfg):
        train = datasets.Dataset.from_dict({k: v.numpy() for k, v in bn_data(256, 0).items()}).with_format("torch")
        evaluation = datasets.Dataset.from_dict({k: v.numpy() for k, v in bn_data(101, 1).items()})
        return train, evaluation.with_format("torch")

    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["label"])

    def eval_metrics(self, model, batch):
        logits = model(batch["x"])
        return {"loss": F.cross_entropy(logits, batch["label"], reduction="none"),
                "accuracy": (logits.argmax(1) == batch["label"]).float()}  # fmt: skip
