"""Preference tuning's quantities for `compute_loss`: each completion's log-probability, and the DPO or SimPO loss
of chosen/rejected pairs with the metrics TRL logs, in the exact form (sums over pairs with their count).

    targets = at.completion_targets(batch["input_ids"], batch["completion_mask"])       # the completions' tokens
    logps = at.sequence_logps(at.lm_token_losses(model, inputs, targets), targets)      # per sequence, in chunks
    chosen, rejected = logps.chunk(2)          # a micro-batch is [chosen of each pair; rejected of each pair]
    return at.preference_loss(at.preference_terms(chosen, rejected, ref_chosen, ref_rejected, beta=0.1))

The conventions are TRL 1.16's `DPOTrainer` (trl/trainer/dpo_trainer.py `_compute_loss`): a completion's
log-probability is the SUM over its tokens (the prompt's count for nothing), the sigmoid loss
-log σ(β((π_c - ref_c) - (π_r - ref_r))), the rewards β(π - ref), and an accuracy counts a pair whose chosen reward
is strictly above the rejected one's (so a first step, where the policy is the reference, has accuracy 0). SimPO
(Meng et al. 2024, as `trl.experimental.cpo` computes it with `loss_type="simpo"` and `cpo_alpha=0`) needs no
reference: the AVERAGE log-probability per completion token, -log σ(β(π_c - π_r) - γ), and its rewards β·π.

Returned as `{"loss": Σ losses, "num_items": pairs, "rewards/chosen": Σ ...}`, every term is divided by the pairs
of the whole optimizer step on every process, so the loss and the logged metrics are those of one big batch under
accumulation, DDP and FSDP, where TRL logs the mean of each micro-batch's means.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def completion_targets(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """The targets of each position, aligned with the inputs: the next token where it is the completion's (its
    `completion_mask` set), IGNORE_INDEX elsewhere and at the last position. Shape of `input_ids`."""
    targets = input_ids[:, 1:].masked_fill(completion_mask[:, 1:] == 0, IGNORE_INDEX)
    return torch.cat([targets, torch.full_like(targets[:, :1], IGNORE_INDEX)], dim=1)


def sequence_logps(token_losses: torch.Tensor, targets: torch.Tensor, *, average: bool = False) -> torch.Tensor:
    """Each sequence's log-probability of its targets from each position's loss (0 where ignored): minus their
    sum, or with `average` that over the targets' count (SimPO's). Shape (batch,)."""
    logps = -token_losses.sum(dim=1)
    return logps / (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1) if average else logps


def completion_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Each sequence's log-probability of its completion tokens: the sum over the tokens where `completion_mask` is
    set of log p(token | the tokens before), from logits in float32 whatever their precision; with `average`, that
    sum over the completion's token count (SimPO's). Shape (batch,). From the model itself, without its logits:
    `sequence_logps(at.lm_token_losses(model, inputs, targets), targets)` with `completion_targets`."""
    targets = completion_targets(input_ids, completion_mask)
    return sequence_logps(token_losses_of_logits(logits, targets), targets, average=average)


def token_losses_of_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's cross-entropy of its target from the logits in float32, 0 where ignored (shape of targets):
    what `at.lm_token_losses` computes without the logits."""
    losses = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )  # the vocabulary as the last, contiguous dimension: a strided one (logits.transpose(1, 2)) is 1e-4 off in the
    # mean loss of a 135M model (tests/test_real_models.py compares with TRL)
    return losses.view(targets.shape)


def preference_terms(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
    *,
    beta: float,
    loss: Literal["dpo", "simpo"] = "dpo",
    simpo_gamma: float = 0.5,
) -> dict[str, torch.Tensor]:
    """Each pair's loss and metrics, named as TRL logs them: `loss`, `rewards/chosen`, `rewards/rejected`,
    `rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected` (tensors of shape (pairs,)).

    Args:
        chosen: the policy's completion log-probabilities of the chosen completions (sums for DPO, averages for
            SimPO), shape (pairs,).
        rejected: the same of the rejected completions.
        ref_chosen: the reference's of the chosen completions, for DPO; SimPO takes none.
        ref_rejected: the reference's of the rejected completions.
        beta: DPO's β (TRL's default 0.1), SimPO's β.
        loss: "dpo" (sigmoid) or "simpo".
        simpo_gamma: SimPO's target margin γ (TRL's default 0.5).
    """
    if loss == "dpo":
        if ref_chosen is None or ref_rejected is None:
            raise ValueError("the DPO loss needs the reference's log-probabilities (ref_chosen, ref_rejected)")
        chosen_rewards = beta * (chosen - ref_chosen).detach()
        rejected_rewards = beta * (rejected - ref_rejected).detach()
        logits = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    elif loss == "simpo":
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
        logits = beta * (chosen - rejected) - simpo_gamma
    else:
        raise ValueError(f"loss={loss!r}: dpo or simpo")
    return {
        "loss": -F.logsigmoid(logits),
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/margins": chosen_rewards - rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
    }


def preference_loss(terms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`preference_terms` summed over the micro-batch's pairs, with their count: what `compute_loss` returns for
    an exact mean over the optimizer step's pairs (see the module's docstring)."""
    pairs = terms["loss"].shape[0]
    return {"num_items": torch.tensor(pairs, device=terms["loss"].device)} | {
        name: values.sum() for name, values in terms.items()
    }
