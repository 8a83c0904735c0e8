"""A small MLP classifying scikit-learn's handwritten digits: the shortest complete recipe, and the template
`accel-trainer new NAME` copies. Expect eval accuracy above 0.95 after the default 600 steps (a few seconds).

    python recipes/mlp.py max_steps=300
    accel-trainer train recipes/mlp.py layout=cpu_ddp      # on 2 processes, from any folder
"""

from dataclasses import dataclass

import datasets
from torch import nn

import accel_trainer as at


@dataclass
class MlpConfig(at.TrainConfig):
    max_steps: int = 600
    log_every_steps: int = 100
    eval_every_steps: int = 300
    lr: float = 3e-3
    hidden: int = 128
    """Width of the hidden layer."""


@at.register_recipe("mlp")
class Mlp(at.Recipe):
    """MLP on 8x8 digits: 64 pixels -> hidden -> 10 classes."""

    Config = MlpConfig

    def build_model(self, cfg):
        return nn.Sequential(nn.Linear(64, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 10))

    def build_datasets(self, cfg):
        from sklearn.datasets import load_digits  # here, not above: listing a recipe imports its file

        digits = load_digits()
        table = datasets.Dataset.from_dict({"x": digits.data.astype("float32") / 16, "y": digits.target})
        splits = table.train_test_split(test_size=0.2, seed=0)
        return splits["train"], splits["test"]

    def compute_loss(self, model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def eval_metrics(self, model, batch):
        logits = model(batch["x"])
        correct = (logits.argmax(dim=1) == batch["y"]).float()
        return {"loss": nn.functional.cross_entropy(logits, batch["y"], reduction="none"), "accuracy": correct}


if __name__ == "__main__":
    at.main("mlp")
