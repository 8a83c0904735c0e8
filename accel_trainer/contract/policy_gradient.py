"""GRPO's objective: each group's advantages of its rewards, and the clipped policy-gradient loss, as TRL 1.16's
`GRPOTrainer` computes them (`_generate_and_score_completions`, `_compute_loss`), in the loss contract's terms.

    advantages = at.group_advantages(rewards, num_generations=8, scale_rewards="group")
    return at.policy_gradient_loss(logps, completion_mask, advantages, loss_type="dapo")   # in compute_loss

A group is one prompt's `num_generations` completions; a completion's advantage is its reward less its group's
mean, divided by the group's standard deviation (`scale_rewards="group"`, TRL's default), the whole step's
(`"batch"`: every process's rewards of the step, which the caller gathers), or by nothing (`"none"`, Dr. GRPO's
choice). Rewards may be NaN (every reward function declined to score a completion, as TRL allows with None): they
count in no mean or deviation, and their advantage is 0.

The loss of a completion token is -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A), r the ratio of the
token's probability under the training weights to the one it had when sampled (`old_logps`; the same weights, so
r = 1 with a gradient, when a generation feeds one optimizer step), plus `beta` times the k3 estimate of the KL to
the reference. The loss types differ only in what the sum of those is divided by, which here is the `num_items`
the loop divides the whole optimizer step's sum by, over every micro-batch and process, exactly:

    dapo     every completion token of the step (TRL's default: its `num_items_in_batch`)
    grpo     every completion of the step, each completion's tokens averaged first
    dr_grpo  every completion of the step times max_completion_length
    bnpo     each micro-batch's own tokens (TRL's definition: the loss depends on the micro-batch size; returned
             as a micro-batch mean, which the loop averages over micro-batches and processes as TRL does)

So dapo, grpo and dr_grpo follow the same trajectory on every layout and equal TRL's loss where its micro-batches
hold whole groups (tests/unit/test_policy_gradient.py feeds both the same tensors). The returned terms, logged
with the loss's normalisation: `kl` (beta > 0) and the clipped shares `clip_ratio/low`, `clip_ratio/high`,
`clip_ratio/region` (TRL's `clip_ratio/*_mean`): means over the step's tokens under dapo, over its completions
(of each one's token mean) under grpo and dr_grpo, of the micro-batches' token means under bnpo.
"""

from __future__ import annotations

import torch

from accel_trainer.errors import RecipeError

LOSS_TYPES: tuple[str, ...] = ("dapo", "grpo", "dr_grpo", "bnpo")
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
STD_FLOOR = 1e-4
"""Added to the deviation an advantage is divided by (TRL's): a group whose rewards are all equal gets 0, not NaN."""


def group_advantages(
    rewards: torch.Tensor,
    *,
    num_generations: int,
    scale_rewards: str = "group",
    step_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each completion's advantage: `rewards` (one per completion, groups of `num_generations` in a row) less
    their group's mean, divided by the deviation `scale_rewards` names. `"batch"` takes the deviation of
    `step_rewards` (every reward of the optimizer step, all processes'; default `rewards`)."""
    if scale_rewards not in SCALE_REWARDS:
        raise RecipeError(f"scale_rewards={scale_rewards}: use one of {', '.join(SCALE_REWARDS)}")
    if rewards.numel() % num_generations:
        raise RecipeError(f"{rewards.numel()} rewards do not make groups of num_generations={num_generations}")
    groups = rewards.view(-1, num_generations)
    advantages = (groups - torch.nanmean(groups, dim=1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        deviation = nan_std(groups, dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        deviation = nan_std(rewards if step_rewards is None else step_rewards).expand_as(advantages)
    if scale_rewards != "none":
        advantages = advantages / (deviation + STD_FLOOR)
    return torch.nan_to_num(advantages, nan=0.0)


def nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (n - 1) of `values` that are not NaN, as TRL's `nanstd`; NaN for fewer than
    two values (a group of one has no spread: TRL's too)."""
    keep = dim is not None
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=keep)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=keep)
    return (variance * count / (count - 1)).sqrt()


def policy_gradient_loss(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss_type: str = "dapo",
    old_logps: torch.Tensor | None = None,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """The loss of a micro-batch of completions, `{"loss": sum, "num_items": n, <terms>}` (bnpo: a mean), from
    each completion token's log-probability under the training weights (`logps`, shape (completions, length),
    with gradients), the `mask` of its completion tokens, and each completion's advantage. `old_logps`: the
    tokens' log-probabilities when sampled (None: these weights, r = 1); `delta`: TRL's two-sided clip of r;
    `ref_logps`: the reference's, for `beta` > 0; `max_completion_length`: dr_grpo's constant."""
    check_loss_type(loss_type, beta, ref_logps, max_completion_length)
    mask = mask.to(logps.dtype)
    advantage = advantages.to(logps.dtype).unsqueeze(1)
    ratio = torch.exp(logps - (logps.detach() if old_logps is None else old_logps))
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    token_loss = -torch.min(unclipped * advantage, clipped * advantage)
    low = ((ratio < 1 - epsilon_low) & (advantage < 0)).to(logps.dtype)
    high = ((ratio > 1 + epsilon_high) & (advantage > 0)).to(logps.dtype)
    per_token = {"clip_ratio/low": low, "clip_ratio/high": high, "clip_ratio/region": torch.maximum(low, high)}
    if beta != 0.0:
        assert ref_logps is not None  # check_loss_type's
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        token_loss = token_loss + beta * kl
        per_token["kl"] = kl.detach()
    return _reduced(token_loss, per_token, mask, loss_type, max_completion_length)


def check_loss_type(
    loss_type: str, beta: float = 0.0, ref_logps: torch.Tensor | None = None, max_completion_length: int | None = None
) -> None:
    """Refuse, in one line, a loss type not known or lacking what it needs."""
    if loss_type not in LOSS_TYPES:
        raise RecipeError(f"loss_type={loss_type}: use one of {', '.join(LOSS_TYPES)}")
    if beta != 0.0 and ref_logps is None:
        raise RecipeError(f"beta={beta}: the KL term needs the reference's log-probabilities (ref_logps)")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise RecipeError("loss_type=dr_grpo divides by max_completion_length: pass it")


def _reduced(
    token_loss: torch.Tensor,
    per_token: dict[str, torch.Tensor],
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None,
) -> dict[str, torch.Tensor]:
    """The loss and its terms summed (or averaged) over the tokens as `loss_type` normalises them."""
    everything = {"loss": token_loss, **per_token}
    if loss_type == "dapo":
        return {**{name: (value * mask).sum() for name, value in everything.items()}, "num_items": mask.sum()}
    if loss_type == "bnpo":
        tokens = mask.sum().clamp(min=1.0)
        return {name: (value * mask).sum() / tokens for name, value in everything.items()}
    completion_means = {
        name: ((value * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() for name, value in everything.items()
    }
    completions = torch.tensor(float(mask.shape[0]), device=mask.device)
    if loss_type == "grpo":
        return {**completion_means, "num_items": completions}
    length = float(max_completion_length or 1)  # dr_grpo: the terms scaled alike, so that they log as grpo's
    terms = {name: value * length for name, value in completion_means.items() if name != "loss"}
    return {"loss": (token_loss * mask).sum(), **terms, "num_items": completions * length}
