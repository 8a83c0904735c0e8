"""A loss computed without calling the model is a one-line error on every layout.

Under DDP only the prepared model's own forward averages the gradients: a `compute_loss` that calls a
submodule (`model.module[0](x)`, `model.encoder(x)`) would train each process on its own gradients without a
word. The check runs on one process too, so such a recipe fails before it ever reaches DDP.
"""

from __future__ import annotations

import pytest
from torch import nn

import accel_trainer as at
from accel_trainer.errors import RecipeError

Mlp = at.get_recipe("mlp")


class ThroughASubmodule(Mlp):
    def compute_loss(self, model, batch):
        inner = getattr(model, "module", model)  # what a recipe reaching past the DDP wrapper does
        hidden = inner[0](batch["x"])
        for layer in list(inner)[1:]:
            hidden = layer(hidden)
        return nn.functional.cross_entropy(hidden, batch["y"])


class ThroughTheModel(Mlp):
    def compute_loss(self, model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def test_a_loss_computed_through_a_submodule_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(at.registry._recipes, "mlp_submodule", ThroughASubmodule)

    with pytest.raises(RecipeError, match=r"compute_loss never called model\(\.\.\.\): call the model it is given"):
        at.train(
            "mlp_submodule",
            max_steps=1,
            eval_every_steps=0,
            output_dir=str(tmp_path),
            show_progress_bar=False,
            report=False,
        )


def test_a_loss_computed_through_the_model_trains(tmp_path, monkeypatch):
    monkeypatch.setitem(at.registry._recipes, "mlp_through_model", ThroughTheModel)

    result = at.train("mlp_through_model", max_steps=2, eval_every_steps=0, output_dir=str(tmp_path),
                      show_progress_bar=False, report=False)  # fmt: skip

    assert result.metrics["step"] == 2
