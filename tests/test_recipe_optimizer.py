"""The recipe's optimizer and schedule are used as written.

Each param group's own learning rate is its peak (the built-in schedule and the batch-size rule multiply
it), `build_scheduler` replaces the built-in schedule and is stepped once per optimizer step, saved and
restored, and every group's LR is logged. Settings that cannot take effect are warned about.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import datasets
import pytest
import torch

import accel_trainer as at
from conftest import final_parameters, read_metrics, reset_accelerate_state

STEPS = 12


@dataclass
class RegressionConfig(at.TrainConfig):
    max_steps: int = STEPS
    global_batch_size: int = 8
    micro_batch_size: int = 8
    lr_schedule: Literal["cosine", "linear", "constant"] = "constant"
    log_every_steps: int = 1
    show_progress_bar: bool = False


@at.register_recipe("two_lr_groups")
class TwoLearningRates(at.Recipe):
    """SGD with a small LR for the body and a large one for the head."""

    Config = RegressionConfig

    def build_model(self, cfg):
        return torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    def build_datasets(self, cfg):
        x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
        return datasets.Dataset.from_dict({"x": x, "y": x.sum(1, keepdim=True)}).with_format("torch"), None

    def build_optimizer(self, cfg, model):
        return torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.05},
                                {"params": model[2].parameters(), "lr": 0.5}])  # fmt: skip

    def compute_loss(self, model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def one_cycle(optimizer, total_steps: int):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[0.1, 0.2], total_steps=total_steps)


@at.register_recipe("one_cycle")
class OneCycle(TwoLearningRates):
    """The same model and optimizer, scheduled by the recipe's own OneCycleLR."""

    def build_scheduler(self, cfg, optimizer):
        return one_cycle(optimizer, cfg.max_steps)


def train(recipe: str, run_dir, **overrides) -> list[dict]:
    at.train(recipe, output_dir=str(run_dir), **overrides)
    reset_accelerate_state()
    return [r for r in read_metrics(run_dir) if "loss" in r]


def test_each_group_trains_at_its_own_learning_rate(tmp_path):
    records = train("two_lr_groups", tmp_path)

    assert {(r["lr"], r["lr/1"]) for r in records} == {(0.05, 0.5)}


def test_the_schedule_and_the_batch_size_rule_multiply_each_groups_peak(tmp_path):
    records = train("two_lr_groups", tmp_path, lr_schedule="linear", warmup_steps=4, lr_scaling="linear",
                    reference_batch_size=4)  # fmt: skip

    peak_body, peak_head = 0.05 * 2, 0.5 * 2  # global batch 8 / reference 4
    assert records[3]["lr"] == pytest.approx(peak_body) and records[3]["lr/1"] == pytest.approx(peak_head)
    assert [r["lr/1"] / r["lr"] for r in records] == pytest.approx([10.0] * STEPS)
    assert records[0]["lr"] == pytest.approx(peak_body / 4)  # warmup, step 1 of 4


def test_a_recipe_scheduler_is_followed_exactly_and_resumed_exactly(tmp_path):
    reference = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": 0.05}, {"params": [torch.zeros(1)], "lr": 0.5}])
    schedule = one_cycle(reference, STEPS)
    expected = []
    for _ in range(STEPS):
        expected.append([group["lr"] for group in reference.param_groups])
        reference.step()
        schedule.step()

    full = train("one_cycle", tmp_path / "full", save_every_steps=5, keep_last=0)
    resumed = train("one_cycle", tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoints" / "step_00000005"))

    assert [[r["lr"], r["lr/1"]] for r in full] == expected
    assert [[r["lr"], r["lr/1"]] for r in resumed] == expected[5:]
    before, after = final_parameters(tmp_path / "full"), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_settings_that_cannot_take_effect_are_warned_about(tmp_path):
    with pytest.warns(UserWarning, match=r"lr=0.3 has no effect: the recipe's build_optimizer sets its own"):
        train("two_lr_groups", tmp_path / "a", lr=0.3, max_steps=1)
    with pytest.warns(UserWarning, match=r"weight_decay=0.1 has no effect: the recipe's build_optimizer sets its own"):
        train("two_lr_groups", tmp_path / "wd", weight_decay=0.1, max_steps=1)
    with pytest.warns(UserWarning, match="warmup_steps have no effect: the recipe's build_scheduler"):
        train("one_cycle", tmp_path / "b", warmup_steps=3, max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults alone warn about nothing
        train("two_lr_groups", tmp_path / "c", max_steps=1)


def test_build_scheduler_must_return_a_scheduler(tmp_path):
    @at.register_recipe("not_a_scheduler")
    class NotAScheduler(TwoLearningRates):
        def build_scheduler(self, cfg, optimizer):
            return lambda step: 1.0

    with pytest.raises(at.RecipeError, match="build_scheduler returned function, not a torch"):
        train("not_a_scheduler", tmp_path)


@at.register_recipe("one_cycle_in_build_optimizer")
class OneCycleInBuildOptimizer(TwoLearningRates):
    """OneCycleLR built beside its optimizer, stepped from a step hook: what the built-in schedule overrode."""

    def build_optimizer(self, cfg, model):
        optimizer = super().build_optimizer(cfg, model)
        self.schedule = one_cycle(optimizer, cfg.max_steps)
        optimizer.register_step_post_hook(lambda *_: self.schedule.step())
        return optimizer


def test_a_scheduler_attached_in_build_optimizer_is_refused_in_one_line_not_overridden(tmp_path):
    with pytest.raises(at.RecipeError, match=r"build_optimizer attached an LR scheduler .* return that scheduler"
                       r" from build_scheduler\(cfg, optimizer\)") as error:  # fmt: skip
        train("one_cycle_in_build_optimizer", tmp_path)
    assert "\n" not in str(error.value)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # refused before any work


def test_a_scheduler_built_in_build_optimizer_and_returned_by_build_scheduler_is_followed(tmp_path):
    @at.register_recipe("one_cycle_kept_on_self")
    class Kept(TwoLearningRates):
        def build_optimizer(self, cfg, model):
            optimizer = super().build_optimizer(cfg, model)
            self.schedule = one_cycle(optimizer, cfg.max_steps)
            return optimizer

        def build_scheduler(self, cfg, optimizer):
            return self.schedule

    assert [r["lr/1"] for r in train("one_cycle_kept_on_self", tmp_path / "kept")] == [
        r["lr/1"] for r in train("one_cycle", tmp_path / "returned")
    ]


def test_a_scheduler_of_another_optimizer_is_refused(tmp_path):
    @at.register_recipe("scheduler_of_another_optimizer")
    class Other(TwoLearningRates):
        def build_scheduler(self, cfg, optimizer):
            return one_cycle(super().build_optimizer(cfg, torch.nn.Sequential(*self.build_model(cfg))), 10)

    with pytest.raises(at.RecipeError, match="build_scheduler returned a scheduler of another optimizer"):
        train("scheduler_of_another_optimizer", tmp_path)


@at.register_recipe("alternating_by_hook")
class AlternatingByHook(TwoLearningRates):
    """One optimizer whose pre-step hook drops one half's gradients on alternate steps (the two-phase workaround),
    and records the learning rates every step it sees."""

    def build_optimizer(self, cfg, model):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        body, head = list(model[0].parameters()), list(model[2].parameters())
        self.seen_lrs = []

        def drop_off_phase(optimizer, args, kwargs):
            self.seen_lrs.append(optimizer.param_groups[0]["lr"])
            states = [optimizer.state.get(parameter, {}) for parameter in (body[0], head[0])]
            taken = sum(int(state.get("step", 0)) for state in states)  # checkpointed, so a resume keeps the phase
            for parameter in head if taken % 2 == 0 else body:
                parameter.grad = None

        optimizer.register_step_pre_hook(drop_off_phase)
        return optimizer


def test_a_resume_runs_no_step_hook_and_continues_a_hooked_optimizer_bitwise(tmp_path, monkeypatch):
    full = tmp_path / "full"
    train("alternating_by_hook", full, save_every_steps=5, keep_last=0)
    built = []
    build_optimizer = AlternatingByHook.build_optimizer
    monkeypatch.setattr(AlternatingByHook, "build_optimizer",
                        lambda self, cfg, model: built.append(self) or build_optimizer(self, cfg, model))  # fmt: skip
    train("alternating_by_hook", tmp_path / "resumed", resume=str(full / "checkpoints" / "step_00000005"))

    (recipe,) = built
    assert recipe.seen_lrs == [0.01] * (STEPS - 5)  # no phantom step at lr 0 while loading the checkpoint
    before, after = final_parameters(full), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_canary_torch_checkpoint_loading_steps_a_fresh_optimizer_and_fires_its_hooks():
    """checkpoint_restore.step_hooks_silenced exists because of this; when it fails, torch stopped doing it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    seen = []
    optimizer.register_step_pre_hook(lambda optimizer, *_: seen.append(optimizer.param_groups[0]["lr"]))
    get_state_dict(model, optimizer)
    assert seen == [0.0]
