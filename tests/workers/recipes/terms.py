"""A regression recipe that logs extra loss terms, for the loss-output tests.

The terms depend on the data only, so a log window that spans exactly one epoch must report their dataset
means whatever the order, the layout or the accumulation: `x_mean` as a batch mean (`per_item=false`), or
`weight` as a sum over a variable number of items per sample (`per_item=true`, each sample counting `n` items).
`n_mean` comes with a count of its own, the batch's samples: the samples' mean of `n` whatever the loss counts.
"""

from dataclasses import dataclass

import datasets
import torch

import accel_trainer as at

NUM_SAMPLES = 64


def term_data() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.rand(NUM_SAMPLES, 1, generator=generator)
    return {"x": x, "y": 2 * x + 1, "n": torch.randint(1, 6, (NUM_SAMPLES,), generator=generator).float(),
            "w": torch.rand(NUM_SAMPLES, generator=generator)}  # fmt: skip


@dataclass
class TermsConfig(at.TrainConfig):
    global_batch_size: int = 16
    micro_batch_size: int = 8
    per_item: bool = False
    """Return the loss and the term as sums over `n` items per sample, with num_items."""


@at.register_recipe("terms")
class TermsRecipe(at.Recipe):
    """Linear regression that also returns a data-only extra term."""

    Config = TermsConfig

    def build_model(self, cfg):
        return torch.nn.Linear(1, 1)

    def build_datasets(self, cfg):
        return datasets.Dataset.from_dict({k: v.numpy() for k, v in term_data().items()}).with_format("torch"), None

    def compute_loss(self, model, batch):
        errors = (model(batch["x"]) - batch["y"]).pow(2).squeeze(1)
        n_mean = (batch["n"].sum(), len(batch["n"]))
        if self.cfg.per_item:
            return {"loss": (errors * batch["n"]).sum(), "num_items": batch["n"].sum(), "weight": batch["w"].sum(),
                    "n_mean": n_mean}  # fmt: skip
        return {"loss": errors.mean(), "x_mean": batch["x"].mean(), "n_mean": n_mean}
