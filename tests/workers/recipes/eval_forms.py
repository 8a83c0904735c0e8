"""A digits classifier whose eval metrics take every form `eval_metrics` may return, for the exact-eval tests.

`loss` is the default eval of a mean `compute_loss` (a batch mean), `token_loss` a (sums, num_items) pair
weighted by a per-sample count, `mean_accuracy` a 0-dim batch mean, `accuracy` per-sample and
`python_accuracy` a Python number. The eval set holds `num_eval` samples, so it does not divide over the
processes (63: a 2-process last batch with one duplicate; 52: a process whose last batch is all duplicates).
"""

from dataclasses import dataclass

import datasets
import torch
from torch import nn

import accel_trainer as at


def digits(num_eval: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    from sklearn.datasets import load_digits  # here, not above: listing a recipe imports its file

    data = load_digits()
    x, y = data.data.astype("float32") / 16, data.target
    counts = 1 + (torch.arange(len(y)) % 5)  # items per sample, for the weighted metric
    table = datasets.Dataset.from_dict({"x": x, "y": y, "n": counts.numpy()}).with_format("torch")
    return table.select(range(256)), table.select(range(256, 256 + num_eval))


@dataclass
class EvalFormsConfig(at.TrainConfig):
    max_steps: int = 6
    global_batch_size: int = 16
    micro_batch_size: int = 8
    eval_every_steps: int = 3
    log_every_steps: int = 3
    lr: float = 1e-2
    num_eval: int = 63
    """Samples in the eval set."""
    forms: bool = True
    """Return every metric form from eval_metrics; false keeps the default eval (the mean loss only)."""
    nan_metric: bool = False
    """eval_metrics returns `loss` and `broken`, a metric that is always NaN."""


@at.register_recipe("eval_forms")
class EvalForms(at.Recipe):
    """Linear digits classifier with a mean compute_loss and eval metrics of every form."""

    Config = EvalFormsConfig

    def build_model(self, cfg):
        return nn.Linear(64, 10)

    def build_datasets(self, cfg):
        return digits(cfg.num_eval)

    def compute_loss(self, model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def eval_metrics(self, model, batch):
        if not self.cfg.forms:
            return super().eval_metrics(model, batch)
        if self.cfg.nan_metric:
            return {**super().eval_metrics(model, batch), "broken": torch.full((len(batch["y"]),), float("nan"))}
        logits = model(batch["x"])
        losses = nn.functional.cross_entropy(logits, batch["y"], reduction="none")
        correct = (logits.argmax(dim=1) == batch["y"]).float()
        return {
            **super().eval_metrics(model, batch),
            "token_loss": (losses * batch["n"], batch["n"]),
            "mean_accuracy": correct.mean(),
            "accuracy": correct,
            "python_accuracy": correct.mean().item(),
        }
