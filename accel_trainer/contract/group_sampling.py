"""Sampling one prompt's group of completions, the same on every layout (online RL: GRPO).

A GRPO step samples `num_generations` completions per prompt from the current weights. The framework promises
that 1 process, DDP and FSDP2 sample the same completions bit for bit, so `sample_group` takes one prompt at a
time and makes the group depend on nothing but the weights, the prompt and a key:
- the batch is the group itself, `num_generations` copies of one prompt (transformers' `num_return_sequences`):
  no padding and the same shapes on every layout, so the same logits, whichever process or micro-batch holds it;
- its random draws come from a stream seeded by `key`, (run seed, optimizer step, prompt's index in the dataset)
  as the caller builds it, never by the process's rank or what the process sampled before. transformers'
  sampling (5.x `_sample`) draws with `torch.multinomial` from the default generator of the logits' device and
  takes no generator, so the call forks the CPU's and that device's global streams, seeds them, and restores
  the caller's afterwards.

The sampling itself is transformers' `generate` (KV cache, temperature, top-p, top-k, EOS); settings not named
here (repetition penalty, min-p ...) come from the model's `generation_config`, the same on every layout.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch


@dataclass(frozen=True)
class GroupSample:
    """One prompt's group of completions."""

    completion_ids: torch.Tensor
    """[num_generations, L] token ids, L the longest completion; pad_token_id after a completion's EOS."""
    completion_mask: torch.Tensor
    """[num_generations, L] 1 for each completion token up to and including its first EOS, 0 after."""
    finished: torch.Tensor
    """[num_generations] bool: the completion ended with an EOS (False: cut at max_completion_length)."""


def seed_of(key: Sequence[int]) -> int:
    """A 63-bit seed that mixes the key's ints: BLAKE2b of their decimal text, so (1, 23) and (12, 3) differ, and
    the same in every process, Python version and platform. Not Python's `hash`: salted per process for strings,
    and for ints a simple structured mix that is no promise across versions. The personalization keeps this stream
    apart from any other seed derived from the same ints."""
    text = ",".join(str(int(value)) for value in key).encode()
    digest = hashlib.blake2b(text, digest_size=8, person=b"group_sampling").digest()
    return int.from_bytes(digest, "little") >> 1


def sample_group(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    *,
    num_generations: int,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    top_k: int = 0,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    key: tuple[int, ...],
    synced: bool = False,
) -> GroupSample:
    """Sample `num_generations` completions of one prompt with `model.generate`, seeded by `key` alone.

    Args:
        model: a transformers (or peft) causal LM, in eval mode for the call (`_sampling`). Under DDP, the
            unwrapped module (accelerate's `unwrap_model`: DDP's forward broadcasts buffers, a collective); under
            FSDP2 the sharded module itself, whose every forward all-gathers the weights: hence `synced`.
        prompt_ids: the prompt's token ids, 1-D, unpadded (all attended, even a pad token in a chat prompt).
        temperature, top_p, top_k: as transformers takes them; `top_k=0` is off (else transformers' default, 50).
        eos_token_ids: the tokens that end a completion; `pad_token_id` follows an EOS in `completion_ids`.
        key: the group's stream, e.g. (seed, step, prompt index); see `seed_of`.
        synced: every process runs forwards until all have finished (transformers' `synced_gpus`), for FSDP2 on
            more than one process, where groups end at different lengths. Needs an initialized process group;
            transformers' own detection of FSDP2 sees only models it sharded itself, not accelerate's.

    Returns:
        The group: its completions, their mask, and which of them ended with an EOS.
    """
    with _sampling(model, key, prompt_ids.device):
        sequences = cast(Any, model).generate(
            input_ids=prompt_ids[None],
            attention_mask=torch.ones_like(prompt_ids)[None],  # else a pad token in the prompt may be masked
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_completion_length,
            eos_token_id=list(eos_token_ids),
            pad_token_id=pad_token_id,
            use_cache=True,
            num_return_sequences=num_generations,
            synced_gpus=synced,
        )
    return _masked(sequences[:, prompt_ids.numel() :], eos_token_ids, pad_token_id)


@contextlib.contextmanager
def _sampling(model: torch.nn.Module, key: tuple[int, ...], device: torch.device) -> Iterator[None]:
    """Eval mode (dropout off: a completion is a sample of the policy, not of a dropped-out copy of it), no
    gradients (`no_grad`, not `inference_mode`, whose tensors the next training step could not save for backward),
    and the global random streams of the CPU and `device` seeded by `key`; then each module back in its own mode
    (a part the caller keeps in eval mode stays so) and the caller's streams restored."""
    modes = {module: module.training for module in model.modules()}
    on_accelerator = device.type != "cpu"
    model.eval()
    try:
        with (
            torch.no_grad(),
            torch.random.fork_rng(devices=[device] if on_accelerator else [], device_type=device.type),
        ):
            torch.manual_seed(seed_of(key))  # also this process's other accelerators, which it does not use
            yield
    finally:
        for module, training in modes.items():
            module.training = training


def _masked(completions: torch.Tensor, eos_token_ids: Sequence[int], pad_token_id: int) -> GroupSample:
    """Mask each completion after its first EOS, pad it there, and cut the group to its longest completion."""
    is_eos = torch.isin(completions, torch.tensor(list(eos_token_ids), device=completions.device))
    finished = is_eos.any(dim=1)
    length = completions.shape[1]
    first_eos = torch.where(finished, is_eos.int().argmax(dim=1), length)
    positions = torch.arange(length, device=completions.device)
    mask = (positions[None] <= first_eos[:, None]).long()
    longest = int(mask.sum(dim=1).max()) if length else 0
    ids = completions.masked_fill(mask == 0, pad_token_id)
    return GroupSample(completion_ids=ids[:, :longest], completion_mask=mask[:, :longest], finished=finished)


def right_padded(sequences: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + completion from position 0, padded on the right: a left pad would move a sequence's positions by
    the micro-batch's longest prompt, which differs from layout to layout."""
    ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=pad_id)
    attention = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in sequences], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": mask}
