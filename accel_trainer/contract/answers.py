"""A language model's answers to prompts and the answers.md page that shows them (sft_chat's, dpo's, grpo's), and
dropout off for the exact log-probabilities preference tuning and online RL compare."""

from __future__ import annotations

from typing import Any

import torch


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every dropout module of `model` set to p=0 (TRL's disable_dropout_in_model)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def greedy_answer(model: Any, tokenizer: Any, prompt: Any, max_chars: int, max_tokens: int | None = None) -> str:
    """The model's greedy continuation of a prompt (messages through the chat template, or text), to its end of
    text, `max_chars` characters (cut there, with "..."), or `max_tokens` tokens: generation stops as soon as the
    text is that long (a token is several characters: `max_chars` tokens took ~4x the time and text)."""
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        ids = tokenizer(prompt, return_tensors="pt")
    from accel_trainer.contract.pretrained import base_context  # transformers' import: only where a run answers

    start = ids["input_ids"].shape[1]
    room = (base_context(model) or max_chars + 1 + start) - start
    limit = max(1, min(max_chars + 1, room, max_tokens or room))
    with torch.no_grad():
        output = model.generate(
            **ids, max_new_tokens=limit, do_sample=False, stopping_criteria=[_Characters(tokenizer, start, max_chars)],
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    return shortened(str(tokenizer.decode(output[0, start:], skip_special_tokens=True)).strip(), max_chars)


def shortened(text: str, max_chars: int) -> str:
    """`text`, cut at `max_chars` characters with "..." where it is longer."""
    return text if len(text) <= max_chars else text[:max_chars].rstrip() + "..."


class _Characters:
    """A stopping criterion of transformers' `generate`: the continuation's text is longer than `max_chars`."""

    def __init__(self, tokenizer: Any, start: int, max_chars: int) -> None:
        self.tokenizer, self.start, self.max_chars = tokenizer, start, max_chars

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.start :], skip_special_tokens=True)
        return torch.tensor([len(text.strip()) > self.max_chars for text in texts], device=input_ids.device)


def answers_page(title: str, answered: list[tuple[Any, list[str]]], note: str = "") -> str:
    """answers.md's text: a title, then each prompt in bold (a conversation's last message) with its bullet lines
    (the answers, and what the recipe sets beside them), and a closing `note`."""
    lines = [f"# {title}\n"]
    for prompt, bullets in answered:
        question = (prompt[-1]["content"] if prompt else "") if isinstance(prompt, list) else prompt
        lines += [f"**{question}**\n", *(f"- {bullet}" for bullet in bullets), ""]
    return "\n".join([*lines, note]).rstrip("\n") + "\n"
