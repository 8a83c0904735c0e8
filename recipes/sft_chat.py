"""Chat fine-tuning: a pretrained causal LM taught to answer questions about the Python standard library, its loss
on the assistant's tokens only.

    accel-trainer train hf_causal_lm output_dir=runs/base max_steps=600       # pretrain a base of our own
    accel-trainer train sft_chat base=runs/base/final output_dir=runs/sft      # LoRA (lora_r=8)
    accel-trainer train sft_chat base=runs/base/final lora_r=0 lr=3e-4         # every weight
    accel-trainer sample runs/sft --chat --prompt "What does abc.abstractmethod do?"

Data: questions and answers made from text on disk, the docstrings of the standard library modules the GPT recipe
reads: for each documented public function or class, "What does <module>.<name> do?" answered by the first
sentence of its docstring; loaded as a `datasets.Dataset` of chat messages and split with a fixed seed.
Template: the tokenizer's chat template (transformers' `apply_chat_template`) marks the assistant's reply with
`{% generation %}`, so `return_assistant_tokens_mask=True` gives the tokens the loss reads; the reply ends with the
end-of-text token, which the model learns to write. The tokenizer with its template is saved in final/.
Packing: conversations are packed back to back into windows of block_size + 1 tokens, as the GPT's
pack_sequences packs paragraphs: positions restart and attention stays within each conversation
(hf_causal_lm's `model_inputs`), and a token is a target only where the mask says it is the assistant's.
`eval/loss` is the held-out assistant-token loss; `answers.md` holds the model's answers to a few held-out
questions beside the docstrings'. The model is hf_finetune's: LoRA through peft or every weight, from `base`.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch

import accel_trainer as at

HFCausalLM = at.get_recipe("hf_causal_lm")
HFFinetune = at.get_recipe("hf_finetune")
PretrainedBase = sys.modules[HFFinetune.__module__].PretrainedBase  # base, lora_r, lora_alpha, lora_dropout
gpt_module = sys.modules[at.get_recipe("gpt").__module__]
model_inputs = sys.modules[HFCausalLM.__module__].model_inputs
PAD_ID, IGNORE_INDEX = 256, -100  # as in recipes/gpt.py

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '### Question\\n' + message['content'] + '\\n### Answer\\n' }}"
    "{% else %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}"
)


@dataclass
class SFTChatConfig(PretrainedBase, at.TrainConfig):  # type: ignore[valid-type,misc]
    max_steps: int = 300
    global_batch_size: int = 16
    micro_batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    log_every_steps: int = 20
    eval_every_steps: int = 100
    block_size: int = 128
    """Tokens per packed window (conversations longer than block_size + 1 are left out)."""
    max_answer_chars: int = 160
    """Answers are the docstrings' first sentences, cut to at most this many characters at a word."""
    max_source_bytes: int = 2_000_000
    """As the GPT's: the stdlib files whose docstrings make the questions."""
    eval_fraction: float = 0.05
    """Fraction of the conversations held out for evaluation."""
    split_seed: int = 1234
    """Seed of the train/eval split, fixed so that runs with different seeds share one eval set."""


@at.register_recipe("sft_chat")
class SFTChat(HFFinetune):  # type: ignore[valid-type,misc]
    """A pretrained causal LM fine-tuned to answer stdlib questions, the loss on assistant tokens (LoRA or full)."""

    Config = SFTChatConfig

    def build_tokenizer(self, cfg: SFTChatConfig) -> Any:
        """The base's tokenizer with this recipe's chat template."""
        tokenizer = super().build_tokenizer(cfg)
        tokenizer.chat_template = CHAT_TEMPLATE
        return tokenizer

    def build_datasets(self, cfg: SFTChatConfig) -> tuple[datasets.Dataset, datasets.Dataset]:
        tokenizer = self.tokenizer if self.tokenizer is not None else self.build_tokenizer(cfg)
        splits = conversation_splits(cfg)

        def tokenize(row: dict[str, Any]) -> dict[str, Any]:
            encoded = tokenizer.apply_chat_template(
                row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return {"input_ids": encoded["input_ids"], "assistant_masks": encoded["assistant_masks"]}

        def packed(split: datasets.Dataset) -> datasets.Dataset:
            tokens = split.map(tokenize, remove_columns=["messages"])
            tokens = tokens.filter(lambda row: len(row["input_ids"]) <= cfg.block_size + 1)
            return tokens.map(pack, batched=True, fn_kwargs={"window": cfg.block_size + 1},
                              remove_columns=tokens.column_names)  # fmt: skip

        with gpt_module._quiet_datasets():
            train, held_out = packed(splits["train"]), packed(splits["test"])
        if len(train) == 0 or len(held_out) == 0:
            raise at.ConfigError(
                f"no conversation fits a window of block_size={cfg.block_size} tokens (or none is held out): raise"
                " block_size or max_source_bytes, or lower max_answer_chars"
            )
        return train, held_out

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Packed windows: inputs and targets shifted by one; a target counts where it is the assistant's and in
        its input's conversation; positions from each conversation's start; conversation marks for attention."""
        batch = gpt_module.collate_packed(examples)  # the GPT's packed windows: targets within each conversation
        assistant = torch.stack([torch.as_tensor(example["assistant"], dtype=torch.bool) for example in examples])
        batch["targets"] = batch["targets"].masked_fill(~assistant[:, 1:], IGNORE_INDEX)
        return batch

    def compute_loss(self, model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return at.token_cross_entropy(model(**model_inputs(batch)).logits, batch["targets"], IGNORE_INDEX)

    def write_artifacts(self, model: Any, eval_dataset: Any, run_dir: Path) -> None:
        """`answers.md`: the model's answers (greedy, to the end-of-text token) to the first held-out questions,
        beside the docstrings' answers."""
        tokenizer = self.tokenizer
        held_out = conversation_splits(self.cfg)["test"]  # the eval set's conversations, as messages
        lines = ["# Answers to held-out questions\n"]
        context = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
        for row in held_out.select(range(min(5, len(held_out)))):
            question, reference = row["messages"]
            prompt = tokenizer.apply_chat_template([question], tokenize=True, return_tensors="pt", return_dict=True)
            with torch.no_grad():
                room = context - prompt["input_ids"].shape[1]  # the model's positions end there
                output = model.generate(
                    **prompt, max_new_tokens=min(self.cfg.max_answer_chars + 1, room), do_sample=False,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                )  # fmt: skip
            answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            lines.append(
                f"**{question['content']}**\n\n- model: {answer.strip()}\n- docstring: {reference['content']}\n"
            )
        (run_dir / "answers.md").write_text("\n".join(lines))


def conversation_splits(cfg: SFTChatConfig) -> datasets.DatasetDict:
    """The stdlib conversations as messages, split into "train" and "test" (held out) with the config's seed."""
    rows = [{"messages": messages} for messages in stdlib_questions(cfg.max_source_bytes, cfg.max_answer_chars)]
    return datasets.Dataset.from_list(rows).train_test_split(test_size=cfg.eval_fraction, seed=cfg.split_seed)


def stdlib_questions(max_source_bytes: int, max_answer_chars: int) -> list[list[dict[str, str]]]:
    """A user's question and the assistant's answer for each public function and class, with a docstring, at the
    top level of the corpus files: what it does, answered by its docstring's first sentence."""
    conversations = []
    for file in gpt_module.source_files(max_source_bytes):
        module = Path(file).stem
        try:
            tree = ast.parse(Path(file).read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
                continue
            answer = first_sentence(ast.get_docstring(node) or "", max_answer_chars)
            if answer:
                conversations.append([
                    {"role": "user", "content": f"What does {module}.{node.name} do?"},
                    {"role": "assistant", "content": answer},
                ])  # fmt: skip
    return conversations


def first_sentence(docstring: str, max_chars: int) -> str:
    """The docstring's first sentence on one line, cut at a word to at most max_chars."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
    if len(sentence) > max_chars:
        sentence = sentence[:max_chars].rsplit(" ", 1)[0]
    return sentence


def pack(batch: dict[str, list[Any]], window: int) -> dict[str, list[list[int]]]:
    """Conversations back to back in windows of `window` tokens, each marked with its conversation's number
    (-1 for the padding that ends a window), none cut in two."""
    packed: dict[str, list[list[int]]] = {"input_ids": [], "documents": [], "assistant": []}
    current: dict[str, list[int]] = {key: [] for key in packed}

    def flush() -> None:
        room = window - len(current["input_ids"])
        for key, fill in (("input_ids", PAD_ID), ("documents", -1), ("assistant", 0)):
            packed[key].append(current[key] + [fill] * room)
            current[key] = []

    for number, (ids, mask) in enumerate(zip(batch["input_ids"], batch["assistant_masks"], strict=True)):
        if current["input_ids"] and len(current["input_ids"]) + len(ids) > window:
            flush()
        current["input_ids"] += ids
        current["documents"] += [number] * len(ids)
        current["assistant"] += mask
    if current["input_ids"]:
        flush()
    return packed


if __name__ == "__main__":
    at.main("sft_chat")
