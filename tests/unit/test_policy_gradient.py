"""GRPO's advantages and loss equal TRL 1.16's on the same rewards, log-probabilities and masks (its
`GRPOTrainer._compute_loss`, fed the tensors directly), for each loss type, with the KL term and clipping, over one
micro-batch and accumulated over several (accel_trainer/contract/policy_gradient.py)."""

import types
from collections import defaultdict

import pytest
import torch

import accel_trainer as at
from accel_trainer.contract import policy_gradient
from accel_trainer.errors import RecipeError

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

COMPLETIONS, LENGTH, MAX_COMPLETION_LENGTH = 8, 7, 9


def completions(seed: int, reference: bool = True) -> dict[str, torch.Tensor]:
    """A micro-batch of completions of varied lengths with the log-probabilities GRPO reads: the training
    weights' (a leaf, for gradients), the sampling ones' (off by up to 0.5, so that some ratios are clipped)
    and the reference's."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (COMPLETIONS,), generator=generator)
    mask = (torch.arange(LENGTH) < lengths.unsqueeze(1)).long()
    logps = -torch.rand(COMPLETIONS, LENGTH, generator=generator, dtype=torch.float64) * 3
    old = logps + (torch.rand(COMPLETIONS, LENGTH, generator=generator, dtype=torch.float64) - 0.5)
    rewards = torch.randint(0, 3, (COMPLETIONS,), generator=generator).double()
    batch = {"logps": logps.requires_grad_(), "old": old, "mask": mask, "rewards": rewards}
    if reference:
        batch["ref"] = logps.detach() + (
            torch.rand(COMPLETIONS, LENGTH, generator=generator, dtype=torch.float64) - 0.5
        )
    return batch


def trl_loss(batch, advantages, *, loss_type, beta, accumulation, step_tokens):
    """TRL's `_compute_loss` of one micro-batch, its log-probabilities handed in where its model would compute them."""
    trainer = types.SimpleNamespace(
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        use_vllm=False, model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation,
        max_completion_length=MAX_COMPLETION_LENGTH, _entropy_bonus_enabled=False,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation),
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
    )  # fmt: skip
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        batch["logps"],
        torch.zeros_like(batch["logps"]),
        None,
    )
    inputs = {
        "prompt_ids": torch.zeros(COMPLETIONS, 2, dtype=torch.long), "prompt_mask": torch.ones(COMPLETIONS, 2),
        "completion_ids": torch.zeros(COMPLETIONS, LENGTH, dtype=torch.long), "completion_mask": batch["mask"],
        "advantages": advantages, "old_per_token_logps": batch["old"], "num_items_in_batch": step_tokens,
    }  # fmt: skip
    if beta:
        inputs["ref_per_token_logps"] = batch["ref"]
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, trainer._metrics["train"]


def ours(batch, advantages, *, loss_type, beta):
    return at.policy_gradient_loss(
        batch["logps"], batch["mask"], advantages, loss_type=loss_type, old_logps=batch["old"], epsilon_low=0.2,
        epsilon_high=0.28, beta=beta, ref_logps=batch.get("ref"), max_completion_length=MAX_COMPLETION_LENGTH,
    )  # fmt: skip


def as_the_loop_normalises(outputs):
    """The step's loss as the loop makes it: sums over their num_items, or plain means averaged."""
    if "num_items" in outputs[0]:
        return sum(o["loss"] for o in outputs) / sum(o["num_items"] for o in outputs)
    return sum(o["loss"] for o in outputs) / len(outputs)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", policy_gradient.LOSS_TYPES)
@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_loss_and_its_gradients_equal_trls_for_every_loss_type(loss_type, beta, accumulation):
    micro_batches = [completions(seed) for seed in range(accumulation)]
    step_tokens = sum(batch["mask"].sum() for batch in micro_batches)
    trl_total, our_outputs = 0.0, []
    for batch in micro_batches:
        advantages = at.group_advantages(batch["rewards"], num_generations=4)
        loss, metrics = trl_loss(batch, advantages, loss_type=loss_type, beta=beta, accumulation=accumulation,
                                 step_tokens=step_tokens)  # fmt: skip
        trl_total = trl_total + loss
        our_outputs.append(ours(batch, advantages, loss_type=loss_type, beta=beta))
    our_total = as_the_loop_normalises(our_outputs)
    leaves = [batch["logps"] for batch in micro_batches]
    trl_gradients = torch.autograd.grad(trl_total, leaves)
    our_gradients = torch.autograd.grad(our_total, leaves)

    assert torch.allclose(our_total, trl_total, rtol=1e-6, atol=1e-12)
    for our_gradient, trl_gradient in zip(our_gradients, trl_gradients, strict=True):
        assert torch.allclose(our_gradient, trl_gradient, rtol=1e-6, atol=1e-12)
    if accumulation == 1 and loss_type in ("dapo", "bnpo"):  # one micro-batch: TRL's token means are ours
        output = our_outputs[0]
        divisor = output.get("num_items", 1)
        assert float(output["clip_ratio/region"] / divisor) == pytest.approx(metrics["clip_ratio/region_mean"][0])
        assert float(output["clip_ratio/high"] / divisor) == pytest.approx(metrics["clip_ratio/high_mean"][0])
        assert 0 < metrics["clip_ratio/region_mean"][0] < 1  # the data clips some tokens, not all
        if beta:
            assert float(output["kl"] / divisor) == pytest.approx(metrics["kl"][0])


@pytest.mark.parametrize("scale_rewards", policy_gradient.SCALE_REWARDS)
def test_advantages_equal_trls_for_each_scaling_with_unscored_completions_left_out(scale_rewards):
    rewards = torch.tensor([1.0, 0.0, 2.0, float("nan"), 3.0, 3.0, 3.0, 3.0, 0.5, -1.0, 4.0, 0.0])
    groups = rewards.view(-1, 4)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(4)
    if scale_rewards == "batch":
        deviation = trl_utils.nanstd(rewards).expand_as(rewards)
    else:
        deviation = trl_utils.nanstd(groups, dim=1).repeat_interleave(4)
    expected = rewards - mean
    if scale_rewards != "none":
        expected = expected / (deviation + 1e-4)
    expected = torch.nan_to_num(expected, nan=0.0)  # TRL's steps, written out from _generate_and_score_completions

    advantages = at.group_advantages(rewards, num_generations=4, scale_rewards=scale_rewards)

    assert torch.allclose(advantages, expected, rtol=1e-6, atol=1e-7)
    assert advantages[3] == 0  # not scored: no advantage
    assert torch.all(advantages[4:8] == 0)  # a group of equal rewards teaches nothing


def test_batch_scaling_divides_by_the_deviation_of_the_whole_steps_rewards():
    local = torch.tensor([1.0, 0.0, 0.0, 1.0])
    step = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, -5.0, 5.0, -5.0])
    advantages = at.group_advantages(local, num_generations=2, scale_rewards="batch", step_rewards=step)
    assert torch.allclose(advantages, torch.tensor([0.5, -0.5, -0.5, 0.5]) / (step.std() + 1e-4))


def test_a_generation_trained_on_once_has_ratio_one_and_the_plain_policy_gradient():
    batch = completions(0, reference=False)
    advantages = at.group_advantages(batch["rewards"], num_generations=4)
    output = at.policy_gradient_loss(batch["logps"], batch["mask"], advantages)  # old_logps: these weights
    (gradient,) = torch.autograd.grad(output["loss"], batch["logps"])
    assert float(output["clip_ratio/region"]) == 0
    assert torch.allclose(gradient, -advantages.unsqueeze(1) * batch["mask"])  # d/dlogp of -A r at r = 1


def test_what_a_loss_type_lacks_is_a_one_line_error():
    batch = completions(0, reference=False)
    advantages = torch.zeros(COMPLETIONS)
    with pytest.raises(RecipeError, match="loss_type=ppo: use one of dapo, grpo, dr_grpo, bnpo"):
        at.policy_gradient_loss(batch["logps"], batch["mask"], advantages, loss_type="ppo")
    with pytest.raises(RecipeError, match="beta=0.1: the KL term needs the reference's log-probabilities"):
        at.policy_gradient_loss(batch["logps"], batch["mask"], advantages, beta=0.1)
    with pytest.raises(RecipeError, match="dr_grpo divides by max_completion_length"):
        at.policy_gradient_loss(batch["logps"], batch["mask"], advantages, loss_type="dr_grpo")
    with pytest.raises(RecipeError, match="scale_rewards=global: use one of group, batch, none"):
        at.group_advantages(advantages, num_generations=4, scale_rewards="global")
    with pytest.raises(RecipeError, match="8 rewards do not make groups of num_generations=3"):
        at.group_advantages(advantages, num_generations=3)
