"""A small ResNet on scikit-learn's handwritten digits (8x8 greyscale), with random-shift augmentation.

    python recipes/resnet.py                     # 1 CPU process, about a minute on 2 cores
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/resnet.py
    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml recipes/resnet.py   # blocks are FSDP units

Expect eval accuracy of at least 0.97: tests/test_recipes.py checks it on a shortened run of 600 steps; the
default 1500 steps train longer. Residual blocks of two 3x3 convolutions with BatchNorm are the
`wrap_classes`; under DDP or FSDP the BatchNorm running statistics are averaged over the processes before each
evaluation and save, so the evaluated and saved model are the same on every layout. Augmentation shifts each
training image by up to one pixel in each direction (zero padding), drawn from the torch RNG, which the
checkpoints save: a resume is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import torch
import torch.nn.functional as F
from torch import nn

import accel_trainer as at


@dataclass
class ResNetConfig(at.TrainConfig):
    max_steps: int = 1500
    global_batch_size: int = 64
    micro_batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 50
    log_every_steps: int = 250
    eval_every_steps: int = 500
    channels: int = 32
    """Channels of every residual block."""
    num_blocks: int = 3
    """Residual blocks after the stem."""
    max_shift: int = 1
    """Largest random shift, in pixels, of a training image (0: no augmentation)."""


class ResidualBlock(nn.Module):
    """x + BN(conv(ReLU(BN(conv(x))))), then ReLU: the FSDP unit."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, channels: int, num_blocks: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*(ResidualBlock(channels) for _ in range(num_blocks)))
        self.head = nn.Linear(channels, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(images[:, None]))
        return self.head(features.mean(dim=(2, 3)))


def random_shift(images: torch.Tensor, max_shift: int) -> torch.Tensor:
    """Each image moved by up to max_shift pixels along each axis, zeros coming in."""
    if max_shift == 0:
        return images
    padded = F.pad(images, (max_shift,) * 4)
    count, size = len(images), images.shape[-1]
    offsets = torch.randint(0, 2 * max_shift + 1, (2, count, 1), device=images.device)
    rows, cols = offsets + torch.arange(size, device=images.device)  # (count, size) each
    return padded[torch.arange(count, device=images.device)[:, None, None], rows[:, :, None], cols[:, None, :]]


@at.register_recipe("resnet")
class DigitsResNet(at.Recipe):
    """Small ResNet (BatchNorm, residual blocks) on 8x8 digits with random-shift augmentation."""

    Config = ResNetConfig
    wrap_classes = (ResidualBlock,)

    def build_model(self, cfg: ResNetConfig) -> nn.Module:
        return ResNet(cfg.channels, cfg.num_blocks)

    def build_datasets(self, cfg: ResNetConfig) -> tuple[datasets.Dataset, datasets.Dataset]:
        from sklearn.datasets import load_digits  # here, not above: listing a recipe imports its file

        digits = load_digits()
        images = (digits.images / 16).astype("float32")
        table = datasets.Dataset.from_dict({"images": images, "labels": digits.target})
        splits = table.train_test_split(test_size=0.2, seed=0)
        return splits["train"], splits["test"]

    def compute_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        images = random_shift(batch["images"], self.cfg.max_shift)
        return F.cross_entropy(model(images), batch["labels"])

    def eval_metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = model(batch["images"])
        return {
            "loss": F.cross_entropy(logits, batch["labels"], reduction="none"),
            "accuracy": (logits.argmax(dim=1) == batch["labels"]).float(),
        }


if __name__ == "__main__":
    at.main("resnet")
