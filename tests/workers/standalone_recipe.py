"""A recipe in a standalone script, registered with the decorator: the smallest complete user recipe.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/workers/standalone_recipe.py

Fits a line y = 3x - 1 plus noise with a 2-layer MLP; in 60 steps the logged loss falls from about 1 (the
mean over steps 1-20) to about 0.01.
"""

from dataclasses import dataclass

import datasets
import torch
from torch import nn

import accel_trainer as at


@dataclass
class LineConfig(at.TrainConfig):
    hidden: int = 16
    """Hidden width of the MLP."""
    num_samples: int = 512
    """Number of generated (x, y) pairs."""
    lr: float = 3e-2
    max_steps: int = 60
    log_every_steps: int = 20
    global_batch_size: int = 32
    micro_batch_size: int = 8


@at.register_recipe("line")
class Line(at.Recipe):
    """Regression of a noisy line with a small MLP (test recipe)."""

    Config = LineConfig

    def build_model(self, cfg):
        return nn.Sequential(nn.Linear(1, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, 1))

    def build_datasets(self, cfg):
        generator = torch.Generator().manual_seed(0)
        x = torch.rand(cfg.num_samples, 1, generator=generator) * 2 - 1
        y = 3 * x - 1 + 0.01 * torch.randn(cfg.num_samples, 1, generator=generator)
        return datasets.Dataset.from_dict({"x": x.numpy(), "y": y.numpy()}), None

    def compute_loss(self, model, batch):
        return nn.functional.mse_loss(model(batch["x"]), batch["y"])


if __name__ == "__main__":
    at.main("line")
