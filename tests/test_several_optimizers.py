"""Several optimizers: a GAN's discriminator and generator stepped in alternating phases (recipes/gan.py), or
two optimizers stepped together on one loss.

- A plain PyTorch GAN loop (zero grad, backward, clip, step, once per phase) with the same initial weights and
  data ends with the framework's weights: no phase's gradients reach another's step (a negative control keeps
  the last phase's gradients and differs).
- Accumulation, DDP and FSDP follow the 1-process trajectory; a resume continues bitwise, every optimizer and
  schedule restored; each phase's loss, terms, LR and gradient norm are logged.
- The GAN clears a quality bar judged by a classifier trained on real digits.
- Misuse (a parameter in two optimizers, alternation with one optimizer, an unsupported layout) is one line.
"""

from __future__ import annotations

import pytest
import torch

import accel_trainer as at
from accel_trainer.errors import ConfigError, RecipeError
from conftest import final_parameters, read_metrics, reset_accelerate_state, train_and_dump

# The whole training split (1437 digits) as each step's batch: the plain loop needs no sampler to match.
SMALL = dict(hidden=16, max_steps=6, log_every_steps=1, eval_every_steps=0, show_progress_bar=False, report=False)
WHOLE_SET = dict(SMALL, global_batch_size=1437, micro_batch_size=1437)
LAYOUT_RUN = [f"{k}={v}" for k, v in dict(SMALL, global_batch_size=32).items()]
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def train(run_dir, **overrides) -> list[dict]:
    at.train("gan", output_dir=str(run_dir), **overrides)
    reset_accelerate_state()
    return [r for r in read_metrics(run_dir) if "loss" in r]


def plain_gan_loop(steps: int, keep_gradients: bool = False) -> dict[str, torch.Tensor]:
    """The GAN's training written by hand: per step, for each phase in order, drop the gradients, backward,
    clip that optimizer's parameters to max_grad_norm and step it."""
    recipe_cls = at.get_recipe("gan")
    recipe = recipe_cls(recipe_cls.Config(**{k: v for k, v in WHOLE_SET.items() if k != "show_progress_bar"}))
    torch.manual_seed(recipe.cfg.seed)
    model = recipe.build_model(recipe.cfg)
    optimizers = recipe.build_optimizer(recipe.cfg, model)
    train_set, _ = recipe.build_datasets(recipe.cfg)
    batch = train_set.with_format("torch")[:]
    for _ in range(steps):
        for phase, optimizer in optimizers.items():
            if not keep_gradients:
                model.zero_grad(set_to_none=True)
            output = recipe.compute_loss(model, batch, phase=phase)
            (output["loss"] if isinstance(output, dict) else output).backward()
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(parameters, recipe.cfg.max_grad_norm)
            optimizer.step()
    return {name: parameter.detach() for name, parameter in model.named_parameters()}


def test_alternating_phases_train_as_a_plain_gan_loop_and_no_gradient_crosses_phases(tmp_path):
    train(tmp_path, **WHOLE_SET)
    expected, actual = plain_gan_loop(6), final_parameters(tmp_path)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    leaked = plain_gan_loop(6, keep_gradients=True)  # negative control: the test can tell a leak
    assert not all(torch.allclose(leaked[name], actual[name], **TOLERANCE) for name in expected)


def test_each_phase_logs_its_loss_terms_lr_and_gradient_norm(tmp_path):
    records = train(tmp_path, **SMALL)
    record = records[-1]
    for key in ("discriminator/loss", "discriminator/real_accuracy", "generator/loss", "lr/discriminator",
                "lr/generator", "grad_norm/discriminator", "grad_norm/generator", "grad_norm", "lr"):  # fmt: skip
        assert key in record, key
    assert record["loss"] == pytest.approx(record["discriminator/loss"] + record["generator/loss"], rel=1e-6)
    assert record["grad_norm"] == pytest.approx(
        (record["grad_norm/discriminator"] ** 2 + record["grad_norm/generator"] ** 2) ** 0.5, rel=1e-6
    )


@pytest.fixture(scope="module")
def one_process_gan(tmp_path_factory):
    out = tmp_path_factory.mktemp("gan_one_process")
    train_and_dump("cpu", out, "gan", *LAYOUT_RUN, "micro_batch_size=32", "save_every_steps=3", "keep_last=0",
                   world_size=1)  # fmt: skip
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "micro", "world_size"),
    [("cpu", 8, 1), ("cpu_ddp", 16, 2), ("cpu_fsdp", 8, 2), ("cpu_ddp", 8, 2)],
    ids=["accumulation", "ddp", "fsdp-with-accumulation", "ddp-with-accumulation"],
)
def test_alternating_phases_follow_the_one_process_trajectory_on_every_layout(layout, micro, world_size,
                                                                             one_process_gan, tmp_path):  # fmt: skip
    records = train_and_dump(layout, tmp_path, "gan", *LAYOUT_RUN, f"micro_batch_size={micro}",
                             world_size=world_size)  # fmt: skip
    expected, actual = final_parameters(one_process_gan), final_parameters(tmp_path)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    reference = [r for r in read_metrics(one_process_gan) if "loss" in r]
    assert [r["generator/loss"] for r in records if "loss" in r] == pytest.approx(
        [r["generator/loss"] for r in reference], rel=1e-5
    )


@pytest.mark.multiprocess
def test_a_resume_restores_every_optimizer_and_schedule_and_continues_bitwise(one_process_gan, tmp_path):
    checkpoint = one_process_gan / "checkpoints" / "step_00000003"
    train_and_dump("cpu", tmp_path, "gan", *LAYOUT_RUN, "micro_batch_size=32", f"resume={checkpoint}", world_size=1)
    expected, actual = final_parameters(one_process_gan), final_parameters(tmp_path)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_the_gan_draws_digits_a_real_digit_classifier_recognises(tmp_path):
    # measured: a class accuracy of 0.93 at step 1000 (the recipe trains 3000 steps)
    result = at.train("gan", output_dir=str(tmp_path), max_steps=1000, eval_every_steps=1000, show_progress_bar=False,
                      report=False)  # fmt: skip
    assert result.metrics["eval/class_accuracy"] >= 0.8
    assert (tmp_path / "samples.png").is_file()


@at.register_recipe("two_optimizers_together")
class TwoTogether(at.get_recipe("mlp")):  # type: ignore[misc]
    """The mlp with SGD on its first layer and Adam on its second, both stepped on the one loss."""

    def build_optimizer(self, cfg, model):
        return {"body": torch.optim.SGD(model[0].parameters(), lr=0.1), "head": torch.optim.Adam(model[2].parameters())}


def test_optimizers_stepped_together_all_step_on_the_one_loss(tmp_path):
    cfg = at.get_recipe("mlp").Config()
    torch.manual_seed(cfg.seed)  # the framework's initial weights
    before = at.get_recipe("mlp")(cfg).build_model(cfg)
    options = dict(
        max_steps=20,
        eval_every_steps=0,
        lr_schedule="constant",
        log_every_steps=10,
        show_progress_bar=False,
        report=False,
    )
    at.train("two_optimizers_together", output_dir=str(tmp_path / "a"), save_every_steps=10, keep_last=0, **options)
    reset_accelerate_state()
    records = [r for r in read_metrics(tmp_path / "a") if "loss" in r]
    assert {"lr/body", "lr/head", "grad_norm"} <= set(records[-1])
    assert records[-1]["lr/body"] == pytest.approx(0.1) and records[-1]["lr/head"] == pytest.approx(1e-3)
    trained = final_parameters(tmp_path / "a")
    assert not torch.equal(trained["0.weight"], before[0].weight) and not torch.equal(
        trained["2.weight"], before[2].weight
    )
    resume = str(tmp_path / "a" / "checkpoints" / "step_00000010")
    at.train("two_optimizers_together", output_dir=str(tmp_path / "b"), resume=resume, **options)
    resumed = final_parameters(tmp_path / "b")
    assert all(torch.equal(resumed[name], trained[name]) for name in trained)


@pytest.mark.parametrize(
    ("optimizers", "message"),
    [
        (lambda m: {"a": torch.optim.SGD(m.parameters(), lr=0.1), "b": torch.optim.SGD(m[0].parameters(), lr=0.1)},
         r"optimizers 'a' and 'b' both hold parameter 0.weight: give each parameter to one optimizer"),
        (lambda m: {"lr": torch.optim.SGD(m.parameters(), lr=0.1)}, r"named an optimizer 'lr'"),
        (lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)], r"build_optimizer returned list; return a torch"),
    ],
)  # fmt: skip
def test_a_malformed_set_of_optimizers_is_a_one_line_error(optimizers, message, tmp_path):
    @at.register_recipe("malformed_optimizers")
    class Malformed(at.get_recipe("mlp")):  # type: ignore[misc]
        def build_optimizer(self, cfg, model):
            return optimizers(model)

    with pytest.raises(RecipeError, match=message) as error:
        at.train("malformed_optimizers", output_dir=str(tmp_path), max_steps=1, show_progress_bar=False, report=False)
    assert "\n" not in str(error.value)


def test_alternation_needs_several_optimizers_and_auto_micro_batches_are_refused(tmp_path):
    @at.register_recipe("alternating_one")
    class AlternatingOne(at.get_recipe("mlp")):  # type: ignore[misc]
        alternate_optimizers = True

    with pytest.raises(RecipeError, match="alternate_optimizers=True needs build_optimizer to return several"):
        at.train(
            "alternating_one", output_dir=str(tmp_path / "one"), max_steps=1, show_progress_bar=False, report=False
        )
    reset_accelerate_state()
    with pytest.raises(ConfigError, match=r"several optimizers cannot run with micro_batch_size=auto \(set it\)"):
        at.train(
            "gan",
            output_dir=str(tmp_path / "auto"),
            micro_batch_size="auto",
            max_steps=1,
            show_progress_bar=False,
            report=False,
        )


def test_an_alternating_recipe_without_eval_metrics_but_with_an_eval_set_is_a_one_line_error(tmp_path):
    @at.register_recipe("gan_without_eval_metrics")
    class NoEvalMetrics(at.get_recipe("gan")):  # type: ignore[misc]
        eval_metrics = at.Recipe.eval_metrics

    with pytest.raises(RecipeError, match="alternates optimizers, so it has no single loss to evaluate: define"):
        at.train("gan_without_eval_metrics", output_dir=str(tmp_path), **{**SMALL, "eval_every_steps": 3})


@pytest.mark.multiprocess
def test_a_pipeline_layout_refuses_several_optimizers_in_one_line(tmp_path):
    from conftest import accelerate_launch, dump_env

    result = accelerate_launch("cpu_pp", "recipes/gan.py", f"output_dir={tmp_path}",
                               *LAYOUT_RUN, check=False, env=dump_env(tmp_path, 2))  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "exitcode: 2" in output  # each worker's one-line refusal, exit 2
    assert "several optimizers cannot run with a pipeline, tensor-parallel, HSDP or context-parallel layout" in output
    assert "Traceback" not in output.split("ChildFailedError")[0].split("elastic")[0]
    # torch's table after it (the launcher's own, out of the workers' reach) names the line as the root cause
    assert "traceback : accel-trainer: error: several optimizers cannot run with a pipeline" in output


def test_canary_torch_refuses_a_stateless_optimizer_beside_another():
    """checkpoint_restore._several_optimizers_options relaxes torch's strict check because of this."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizers = (torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.Adam(model[1].parameters()))
    model(torch.ones(1, 2)).sum().backward()
    for optimizer in optimizers:
        optimizer.step()
    _, saved = get_state_dict(model, optimizers)
    fresh = (torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.Adam(model[1].parameters()))
    with pytest.raises(RuntimeError, match="Missing optimizer state for parameter '0.weight'"):
        set_state_dict(model, fresh, model_state_dict={}, optim_state_dict=saved)
