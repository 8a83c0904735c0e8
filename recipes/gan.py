"""A conditional GAN on scikit-learn's 8x8 digits: two optimizers stepped in alternating phases, the
discriminator's then the generator's, on the same real samples every step.

    python recipes/gan.py
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/gan.py

Quality is measured the way a GAN's should be, by someone else: a logistic-regression classifier trained on the
real training digits (0.96 accurate on the real eval digits) is asked which digit each generated eval image
shows, and `eval/class_accuracy` is how often it names the digit the generator was asked for. Expect it above
0.8 after the default 3000 steps (about 30 s on one CPU core); `samples.png` shows a row of generated 0-9.

The noise is part of the data (a `noise` column drawn from the seed for each sample), not drawn from each
process's random stream, so 1 and N processes, with or without accumulation, train the same GAN, and a resume
continues it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import accel_trainer as at

if TYPE_CHECKING:
    from sklearn.linear_model import LogisticRegression

NOISE_DIM, NUM_CLASSES, PIXELS = 16, 10, 64


class Generator(nn.Module):
    """(noise, digit) -> an 8x8 image in [-1, 1]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(NOISE_DIM + NUM_CLASSES, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, PIXELS), nn.Tanh(),
        )  # fmt: skip

    def forward(self, noise: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([noise, F.one_hot(labels, NUM_CLASSES).to(noise.dtype)], dim=1))


class Discriminator(nn.Module):
    """(image, digit) -> the logit that the image is a real example of that digit."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(PIXELS + NUM_CLASSES, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([images, F.one_hot(labels, NUM_CLASSES).to(images.dtype)], dim=1)).squeeze(1)


class ConditionalGAN(nn.Module):
    """Both networks behind one forward, so that DDP sees every pass (it averages gradients in its forward's
    backward, not in a submodule's called directly)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.generator, self.discriminator = Generator(hidden), Discriminator(hidden)

    def forward(self, noise: torch.Tensor, labels: torch.Tensor, real: torch.Tensor | None = None) -> Any:
        """Fake images and their logits; with `real`, the discriminator's phase: the fake detached (the generator
        gets no gradient) and the real images' logits too."""
        fake = self.generator(noise, labels)
        if real is None:
            return fake, self.discriminator(fake, labels)
        return fake, self.discriminator(fake.detach(), labels), self.discriminator(real, labels)


def digit_splits(seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The digits in [-1, 1] with their labels and a noise vector per sample (drawn from the seed), split 80/20."""
    from sklearn.datasets import load_digits  # here, not above: listing a recipe imports its file

    digits = load_digits()
    noise = torch.randn(len(digits.target), NOISE_DIM, generator=torch.Generator().manual_seed(seed))
    table = datasets.Dataset.from_dict(
        {"images": (digits.data / 8 - 1).astype("float32"), "labels": digits.target, "noise": noise.numpy()}
    )
    splits = table.train_test_split(test_size=0.2, seed=0)
    return splits["train"], splits["test"]


@dataclass
class GanConfig(at.TrainConfig):
    max_steps: int = 3000
    global_batch_size: int = 64
    micro_batch_size: int = 64
    lr: float = 1e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    log_every_steps: int = 500
    eval_every_steps: int = 1000
    hidden: int = 128
    """Width of both networks' hidden layers."""


@at.register_recipe("gan")
class Gan(at.Recipe):
    """Conditional GAN on 8x8 digits: discriminator and generator stepped in turn, judged by a real-digit classifier."""

    Config = GanConfig
    alternate_optimizers = True
    wrap_classes = (Generator, Discriminator)

    def build_model(self, cfg: GanConfig) -> nn.Module:
        return ConditionalGAN(cfg.hidden)

    def build_datasets(self, cfg: GanConfig) -> tuple[datasets.Dataset, datasets.Dataset]:
        return digit_splits(cfg.seed)

    def build_optimizer(self, cfg: GanConfig, model: nn.Module) -> dict[str, torch.optim.Optimizer]:
        """The discriminator first, then the generator: each step is these two phases, in this order."""
        return {
            "discriminator": torch.optim.Adam(model.discriminator.parameters(), lr=cfg.lr, betas=(0.5, 0.999)),
            "generator": torch.optim.Adam(model.generator.parameters(), lr=cfg.lr, betas=(0.5, 0.999)),
        }

    def compute_loss(self, model: nn.Module, batch: dict[str, torch.Tensor], phase: str) -> dict[str, Any]:
        """The non-saturating GAN losses: the discriminator's on real and fake, the generator's on fooling it."""
        if phase == "discriminator":
            _, fake_logits, real_logits = model(batch["noise"], batch["labels"], batch["images"])
            real = F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits))
            fake = F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
            return {"loss": real + fake, "real_accuracy": (real_logits > 0).float().mean()}
        _, fake_logits = model(batch["noise"], batch["labels"])
        return F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits))

    def eval_metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """How often the real-digit classifier sees the digit the generator was asked for."""
        fake, _ = model(batch["noise"], batch["labels"])
        predicted = self.judge().predict(fake.float().cpu().numpy())
        return {"class_accuracy": torch.as_tensor(predicted == batch["labels"].cpu().numpy(), dtype=torch.float32)}

    def judge(self) -> LogisticRegression:
        """The classifier trained on the real training digits (fitted once, deterministic)."""
        if not hasattr(self, "_judge"):
            from sklearn.linear_model import LogisticRegression

            train, _ = digit_splits(self.cfg.seed)
            self._judge = LogisticRegression(max_iter=2000).fit(
                np.asarray(train["images"]), np.asarray(train["labels"])
            )
        return self._judge

    def write_artifacts(self, model: nn.Module, eval_dataset: Any, run_dir: Path) -> None:
        """Save `samples.png`: two rows of generated digits 0-9 (fixed noise)."""
        from PIL import Image

        labels = torch.arange(NUM_CLASSES).repeat(2)
        noise = torch.randn(len(labels), NOISE_DIM, generator=torch.Generator().manual_seed(self.cfg.seed + 1))
        with torch.no_grad():
            fake, _ = model(noise, labels)
        grid = fake.reshape(2, NUM_CLASSES, 8, 8).permute(0, 2, 1, 3).reshape(16, NUM_CLASSES * 8)
        pixels = ((grid.clamp(-1, 1) + 1) * 127.5).byte().numpy()
        Image.fromarray(pixels).resize((NUM_CLASSES * 32, 64), Image.NEAREST).save(run_dir / "samples.png")


if __name__ == "__main__":
    at.main("gan")
