"""A recipe's `rollout` makes each optimizer step's micro-batches into what `compute_loss` trains on, once a
step, before the step's forwards, with the weights the step starts from (accel_trainer/recipe.py): what online
RL samples and scores its completions in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accel_trainer as at
from accel_trainer.errors import RecipeError

Mlp = at.get_recipe("mlp")


class Labelled(Mlp):
    """The MLP taught, at each step, the labels its weights before the step give (a label only rollout knows)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls: list[tuple[int, int, bool, bool]] = []
        self.trained_on: list[torch.Tensor] = []

    def rollout(self, model, batches, step):
        self.calls.append((step, len(batches), torch.is_grad_enabled(), isinstance(model, nn.Module)))
        model.eval()  # the loop puts the mode back
        return [{**batch, "y": model(batch["x"]).argmax(-1)} for batch in batches]

    def compute_loss(self, model, batch):
        self.trained_on.append(batch["y"])
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def train(tmp_path, monkeypatch, recipe, **overrides):
    monkeypatch.setitem(at.registry._recipes, "mlp_rollout", recipe)
    settings = dict(max_steps=3, global_batch_size=32, micro_batch_size=8, eval_every_steps=0, save_every_steps=0,
                    output_dir=str(tmp_path), show_progress_bar=False, report=False)  # fmt: skip
    return at.train("mlp_rollout", **{**settings, **overrides})


def test_rollout_makes_each_steps_micro_batches_before_their_forwards_without_gradients(tmp_path, monkeypatch):
    made: list[Labelled] = []

    class Recorded(Labelled):
        def __init__(self, cfg):
            super().__init__(cfg)
            made.append(self)

        def compute_loss(self, model, batch):
            assert model.training  # the rollout's eval() was undone
            return super().compute_loss(model, batch)

    result = train(tmp_path, monkeypatch, Recorded)

    recipe = made[-1]
    assert result.metrics["step"] == 3
    assert recipe.calls == [(1, 4, False, True), (2, 4, False, True), (3, 4, False, True)]
    assert len(recipe.trained_on) >= 12  # every micro-batch of every step (and the FLOP count's meta copy)
    assert all(labels.dtype == torch.long for labels in recipe.trained_on)


def test_a_rollout_that_returns_another_count_of_micro_batches_is_a_one_line_error(tmp_path, monkeypatch):
    class Short(Labelled):
        def rollout(self, model, batches, step):
            return super().rollout(model, batches, step)[:1]

    with pytest.raises(RecipeError, match=r"rollout returned 1 micro-batches for the step's 4: return one for each"):
        train(tmp_path, monkeypatch, Short)


def test_only_recipes_that_define_rollout_roll_out():
    assert Labelled.rolls_out() and not Mlp.rolls_out() and not at.Recipe.rolls_out()
