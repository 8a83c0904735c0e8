"""Preference pairs as a model's tokens and batches, as TRL 1.16's DPOTrainer makes them (trl/trainer/
dpo_trainer.py `_prepare_dataset` and `DataCollatorForPreference`), so a loss on them is TRL's.

A row is `prompt`, `chosen`, `rejected`:
- conversational: each a list of {"role", "content"} messages (a completion given as text is the assistant's
  message), rendered with the tokenizer's chat template, the prompt with its generation prompt;
- plain text: tokenized as it is (the tokenizer's own special tokens, a BOS say), the end-of-sequence token
  appended to each completion that lacks it.
Without `prompt`, the prompt is what `chosen` and `rejected` begin with alike (TRL's `extract_prompt`).
The completion's tokens are those after the longest common prefix of the prompt's tokens and the prompt+completion's
(a template may render the prompt alone differently). A micro-batch holds pairs, each one sample, so a pair is
never split; a forward reads it as 2n sequences, every pair's chosen then every pair's rejected. Each sequence is
cut to `max_length` tokens (keeping its start, or its end) and padded on the right. A pair whose prompt alone fills
`max_length` (keeping the start) has nothing left to learn from: it is dropped, and a line counts such pairs.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import datasets
import torch
from accelerate import PartialState

from accel_trainer.data import chat
from accel_trainer.errors import ConfigError

FORMS = [{"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}, {"chosen": "chosen", "rejected": "rejected"}]
"""The columns a source of pairs may have (data.sources.read_data's forms)."""
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
"""The precomputed reference log-probabilities a pair may carry (reference_logps.py)."""


def with_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its prompt: its own, or what its chosen and rejected begin with alike (turns of a conversation,
    or characters of text, the space before the completions left to them), as TRL's `extract_prompt`."""
    if row.get("prompt") is not None:
        return {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}
    chosen, rejected = row["chosen"], row["rejected"]
    end = 0
    while end < min(len(chosen), len(rejected)) and chosen[end] == rejected[end]:
        end += 1
    if isinstance(chosen, str) and end and chosen[end - 1] == " ":
        end -= 1
    return {"prompt": chosen[:end], "chosen": chosen[end:], "rejected": rejected[end:]}


def tokenize_pair(row: dict[str, Any], index: int, tokenizer: Any, split: str) -> dict[str, list[int]]:
    """The pair's `prompt_ids`, `chosen_ids` and `rejected_ids`, for `Dataset.map` (a plain function, which
    datasets can hash for its cache).

    Raises:
        ConfigError: a prompt and completions of different forms, or a completion of no tokens, naming the row.
    """
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    _check_completions(row, f"{split} pair {index}")
    if isinstance(prompt, list):
        chosen, rejected = (_as_messages(completion) for completion in (chosen, rejected))
        prompt_ids = chat.render_ids(tokenizer, prompt, generation_prompt=True)
        chosen_all, rejected_all = (
            chat.render_ids(tokenizer, prompt + c, generation_prompt=False) for c in (chosen, rejected)
        )
    elif all(isinstance(part, str) for part in (prompt, chosen, rejected)):
        eos = tokenizer.eos_token
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        chosen_all, rejected_all = (list(tokenizer(prompt + c)["input_ids"]) for c in (chosen, rejected))
    else:
        raise ConfigError(
            f"{split} pair {index} ({_excerpt(prompt)}): its prompt is {type(prompt).__name__} and its completions"
            f" {type(chosen).__name__}: give all three as text, or the prompt as a list of messages"
        )
    start = min(_common_prefix(prompt_ids, chosen_all), _common_prefix(prompt_ids, rejected_all))
    pair = {"prompt_ids": prompt_ids[:start], "chosen_ids": chosen_all[start:], "rejected_ids": rejected_all[start:]}
    if not pair["chosen_ids"] or not pair["rejected_ids"]:
        raise ConfigError(f"{split} pair {index} ({_excerpt(prompt)}): a completion has no tokens of its own")
    return pair


def tokenized_pairs(rows: datasets.Dataset, tokenizer: Any, split: str, max_length: int, keep: str) -> Any:
    """The rows' pairs as tokens (`tokenize_pair`), those whose prompt alone fills `max_length` (keeping the start)
    dropped with a line counting them on the main process."""
    rows = rows.map(with_prompt, remove_columns=[c for c in rows.column_names if c not in REFERENCE_COLUMNS])
    tokens = rows.map(
        tokenize_pair, with_indices=True, fn_kwargs={"tokenizer": tokenizer, "split": split},
        remove_columns=["prompt", "chosen", "rejected"],
    )  # fmt: skip
    if keep != "start":
        return tokens
    too_long = sum(len(ids) >= max_length for ids in tokens["prompt_ids"])
    if too_long and PartialState().is_main_process:
        warnings.warn(
            f"accel-trainer: {too_long} of {len(tokens)} {split} pairs have a prompt of at least max_length ="
            f" {max_length} tokens, which leaves no completion token: dropped; raise max_length, or"
            " truncation=keep_end keeps the completions' ends",
            stacklevel=2,
        )
    return tokens.filter(lambda row: len(row["prompt_ids"]) < max_length) if too_long else tokens


def collate_pairs(
    examples: list[dict[str, Any]], pad_id: int, max_length: int | None, keep: Literal["start", "end"] = "start"
) -> dict[str, torch.Tensor]:
    """A micro-batch of n pairs: `input_ids` (prompt and completion, cut to `max_length` and padded with `pad_id`
    on the right), `attention_mask` and `completion_mask` (1 on the completion's tokens), each of shape
    (n, 2, length), a pair's chosen then its rejected (a pair is one sample: the framework never cuts it), and the
    reference columns where the pairs carry them. `sequences` lays them out as the model reads them."""
    sequences, masks = [], []
    for completion in ("chosen_ids", "rejected_ids"):
        for example in examples:
            prompt, answer = _ids(example["prompt_ids"]), _ids(example[completion])
            sequences.append(prompt + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
    if max_length is not None:
        cut = slice(None, max_length) if keep == "start" else slice(-max_length, None)
        sequences, masks = [ids[cut] for ids in sequences], [mask[cut] for mask in masks]
    width, pairs = max(len(ids) for ids in sequences), len(examples)
    padded = {
        "input_ids": [ids + [pad_id] * (width - len(ids)) for ids in sequences],
        "attention_mask": [[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences],
        "completion_mask": [mask + [0] * (width - len(mask)) for mask in masks],
    }
    batch = {key: torch.tensor(rows).view(2, pairs, width).transpose(0, 1) for key, rows in padded.items()}
    for column in REFERENCE_COLUMNS:
        if column in examples[0]:
            batch[column] = torch.tensor([float(example[column]) for example in examples])
    return batch


def sequences(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of n pairs as the 2n sequences one forward reads, TRL's order: every pair's chosen, then every
    pair's rejected (so `logps.chunk(2)` gives the chosen and the rejected ones)."""
    return {key: batch[key].transpose(0, 1).flatten(0, 1) for key in ("input_ids", "attention_mask", "completion_mask")}


def _check_completions(row: dict[str, Any], where: str) -> None:
    """Refuse a pair with a missing (null) column, or a completion of no text: a data mistake, which TRL would
    train as an end-of-sequence token alone.

    Raises:
        ConfigError: naming the pair (its number in its split, and its prompt's beginning) and the column.
    """
    for column in ("prompt", "chosen", "rejected"):
        value = row[column]
        if value is None:
            raise ConfigError(f"{where} ({_excerpt(row['prompt'])}): its {column} is missing (null)")
        if column != "prompt" and not _text(value).strip():
            raise ConfigError(f"{where} ({_excerpt(row['prompt'])}): its {column} completion is empty")


def _text(value: Any) -> str:
    """The text of a completion: itself, or its messages' contents."""
    return value if isinstance(value, str) else " ".join(str(message.get("content") or "") for message in value)


def _excerpt(prompt: Any) -> str:
    """The beginning of a prompt (of its last message), to find its row by."""
    text = _text(prompt[-1:] if isinstance(prompt, list) else prompt or "").strip()
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def _ids(values: Any) -> list[int]:
    """Token ids as a list, from a list or from a tensor (a set in torch format)."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _as_messages(completion: Any) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    while length < min(len(ids), len(other)) and ids[length] == other[length]:
        length += 1
    return length
