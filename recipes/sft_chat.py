"""Chat fine-tuning of a pretrained causal LM on your conversations, the loss on the assistant's tokens only.

    accel-trainer train sft_chat base=SmolLM2-135M-Instruct.Q4_1.gguf data=chats.jsonl      # LoRA (lora_r=8)
    accel-trainer train sft_chat base=HuggingFaceTB/SmolLM2-135M-Instruct data=chats.jsonl lora_r=0 lr=3e-5
    accel-trainer train sft_chat base=... data=chats.jsonl eval_data=held_out.jsonl layout=cpu_fsdp
    accel-trainer sample runs/sft --chat --prompt "What does abc.abstractmethod do?"
    accel-trainer train hf_causal_lm output_dir=runs/base max_steps=600       # the demo: a base of our own,
    accel-trainer train sft_chat base=runs/base/final output_dir=runs/sft      # on the stdlib's questions

Data (`data=`, in any form of data/sources.py: .jsonl, .parquet, a folder, a mixture...): rows with a `messages`
column (system, user and assistant turns, any number) or `prompt`/`completion` columns (lists of messages, as TRL
writes them, or plain text: a user's message and the answer). `eval_data=` is the held-out set, else an
eval_fraction of the rows. Without data=, the demo: for each documented public function or class of the stdlib
modules the GPT recipe reads, "What does <module>.<name> do?" answered by its docstring's first sentence.
Template: the base's own chat template (`chat_template=chatml` or a .jinja file to choose another); the assistant's
tokens are those a reply adds to the conversation before it (accel_trainer/data/chat.py), as TRL finds a
completion's. The tokenizer with its template is saved in final/, so `sample --chat` answers in it.
Conversations longer than block_size + 1 tokens are dropped (`long_conversations=cut` keeps their beginning
instead), and a line counts them. Packing: each conversation whole in a window of block_size + 1 tokens, by best
fit decreasing over the whole split, as TRL packs (accel_trainer/data/packing.py), and a line gives each split's
windows and their padding share; positions restart and attention stays within each conversation (hf_causal_lm's
`model_inputs`), and a token is a target only where it is the assistant's. `eval/loss` is the held-out
assistant-token loss (nats per token, as TRL's eval_loss); `answers.md` holds the model's answers to a few
held-out prompts beside the data's.
The model is hf_finetune's: LoRA through peft or every weight, from `base`.
"""

from __future__ import annotations

import ast
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import datasets
import torch
from accelerate import PartialState

import accel_trainer as at
from accel_trainer.contract.answers import answers_page, greedy_answer
from accel_trainer.data import chat, packing

HFCausalLM = at.get_recipe("hf_causal_lm")
HFFinetune = at.get_recipe("hf_finetune")
PretrainedBase = sys.modules[HFFinetune.__module__].PretrainedBase  # base, lora_r, lora_alpha, lora_dropout
gpt_module = sys.modules[at.get_recipe("gpt").__module__]
IGNORE_INDEX = -100  # as in recipes/gpt.py


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
    """Tokens per packed window; a conversation longer than block_size + 1 is dropped or cut (long_conversations)."""
    data: str = ""
    """Your conversations: rows with messages, or prompt/completion, in any form data= takes (.jsonl, .parquet, a
    folder, a save_to_disk folder, a cached hub dataset, a weighted mixture a:0.7,b:0.3). Empty: the demo."""
    eval_data: str = ""
    """Held-out conversations, in data's forms; empty: eval_fraction of the rows is held out."""
    chat_template: str = ""
    """The chat template: empty for the base's own, chatml, or a .jinja file."""
    long_conversations: Literal["drop", "cut"] = "drop"
    """What becomes of a conversation longer than block_size + 1 tokens: drop (left out) or cut (its beginning
    kept); either way a line counts them."""
    max_answer_chars: int = 160
    """The demo's answers are the docstrings' first sentences, cut to at most this many characters at a word."""
    max_source_bytes: int = 2_000_000
    """As the GPT's: the stdlib files whose docstrings make the demo's questions."""
    eval_fraction: float = 0.05
    """Fraction of the conversations held out for evaluation (without eval_data)."""
    split_seed: int = 1234
    """Seed of the train/eval split, fixed so that runs with different seeds share one eval set."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.data, self.eval_data = at.check_data(self.data, self.eval_data)
        self.chat_template = chat.check_template_choice(self.chat_template)


@at.register_recipe("sft_chat")
class SFTChat(HFFinetune):  # type: ignore[valid-type,misc]
    """A pretrained causal LM fine-tuned on conversations, the loss on the assistant's tokens (LoRA or full)."""

    Config = SFTChatConfig

    def build_tokenizer(self, cfg: SFTChatConfig) -> Any:
        """The base's tokenizer with the chosen chat template (its own by default)."""
        tokenizer = super().build_tokenizer(cfg)
        chat.resolve_template(tokenizer, cfg.chat_template)
        return tokenizer

    def build_datasets(self, cfg: SFTChatConfig) -> tuple[datasets.Dataset, datasets.Dataset]:
        tokenizer = self.tokenizer if self.tokenizer is not None else self.build_tokenizer(cfg)
        self.tokenizer = tokenizer  # byte_level reads it
        self.check_data_given(cfg)
        splits = conversation_splits(cfg)
        window = cfg.block_size + 1

        def packed(split: datasets.Dataset, name: str) -> datasets.Dataset:
            options = {"tokenizer": tokenizer, "split": name}
            columns = split.column_names
            tokens = split.map(chat.tokenize_row, with_indices=True, fn_kwargs=options, remove_columns=columns)
            tokens = fit_to_window(tokens, window, cfg.long_conversations, name)
            # the whole split in one batch: best fit chooses among all its conversations (a map batch of 1,000
            # would fit each batch apart); in Arrow, so no Python object per token
            windows = tokens.with_format("arrow").map(pack, batched=True, batch_size=None,
                                                      fn_kwargs={"window": window, "pad_id": self.pad_id},
                                                      remove_columns=tokens.column_names)  # fmt: skip
            return windows.with_format(None)

        with gpt_module._quiet_datasets():
            train, held_out = packed(splits["train"], "training"), packed(splits["test"], "held-out")
        if len(train) == 0 or len(held_out) == 0:
            raise at.ConfigError(
                f"no {'training' if len(train) == 0 else 'held-out'} conversation is left in windows of"
                f" block_size={cfg.block_size} tokens: raise block_size (or give more conversations)"
            )
        if PartialState().is_main_process:
            print(packing_line({"training": train, "held-out": held_out}, window), flush=True)
        return train, held_out

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Packed windows: inputs and targets shifted by one; a target counts where it is the assistant's and in
        its input's conversation; positions from each conversation's start; conversation marks for attention."""
        batch = gpt_module.collate_packed(examples)  # the GPT's packed windows: targets within each conversation
        assistant = torch.stack([torch.as_tensor(example["assistant"], dtype=torch.bool) for example in examples])
        batch["targets"] = batch["targets"].masked_fill(~assistant[:, 1:], IGNORE_INDEX)
        return batch

    def compute_loss(self, model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.token_loss(model, batch)  # type: ignore[no-any-return]

    def write_artifacts(self, model: Any, eval_dataset: Any, run_dir: Path) -> None:
        """`answers.md`: the model's answers (greedy, to the end-of-text token) to the first held-out prompts (each
        conversation up to its last reply), beside the data's replies."""
        held_out = conversation_splits(self.cfg)["test"]
        answered = []
        for row in held_out.select(range(min(5, len(held_out)))):
            turns = row["messages"]
            last = max(i for i, message in enumerate(turns) if message["role"] == "assistant")
            answer = greedy_answer(model, self.tokenizer, turns[:last], self.cfg.max_answer_chars)
            answered.append((turns[:last], [f"model: {answer}", f"data: {turns[last]['content']}"]))
        (run_dir / "answers.md").write_text(answers_page("Answers to held-out prompts", answered))


def conversation_splits(cfg: SFTChatConfig) -> datasets.DatasetDict:
    """The conversations as rows of `messages`, split into "train" and "test" (held out): eval_data= as the test
    split, else an eval_fraction of the rows with the config's split seed. Without data=, the demo's questions."""
    if not cfg.data:
        questions = stdlib_questions(cfg.max_source_bytes, cfg.max_answer_chars)
        rows = [{"messages": messages, "trained_from": 0} for messages in questions]
        return datasets.Dataset.from_list(rows).train_test_split(test_size=cfg.eval_fraction, seed=cfg.split_seed)
    with gpt_module._quiet_datasets():
        train = as_messages(at.read_data(cfg.data, chat.FORMS, streaming=False, seed=cfg.seed))
        if cfg.eval_data:
            held_out = as_messages(at.read_data(cfg.eval_data, chat.FORMS, streaming=False, seed=cfg.seed))
            return datasets.DatasetDict(train=train, test=held_out)
        return train.train_test_split(test_size=cfg.eval_fraction, seed=cfg.split_seed)


def as_messages(rows: datasets.Dataset) -> datasets.Dataset:
    """Rows of messages, or of prompt/completion, as rows of `messages` and the first message that trains,
    `trained_from` (chat.as_turns)."""
    return rows.map(chat.as_turns, remove_columns=rows.column_names)


def fit_to_window(tokens: datasets.Dataset, window: int, long_conversations: str, name: str) -> datasets.Dataset:
    """The tokenized conversations that fit a window, the longer ones dropped or cut to it (`long_conversations`),
    with a line on the main process counting them."""
    lengths = [len(ids) for ids in tokens["input_ids"]]
    too_long = sum(length > window for length in lengths)
    if too_long == 0:
        return tokens
    if PartialState().is_main_process:
        fate = "dropped" if long_conversations == "drop" else f"cut to their first {window} tokens"
        other = (
            "long_conversations=cut keeps their beginning" if long_conversations == "drop" else "drop leaves them out"
        )
        warnings.warn(
            f"accel-trainer: {too_long} of {len(lengths)} {name} conversations are longer than block_size + 1 ="
            f" {window} tokens (the longest {max(lengths)}): {fate}; raise block_size, or {other}",
            stacklevel=2,
        )
    if long_conversations == "drop":
        return tokens.filter(lambda row: len(row["input_ids"]) <= window)
    return tokens.map(lambda row: {key: values[:window] for key, values in row.items()})


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


def pack(rows: Any, window: int, pad_id: int) -> Any:
    """A split's tokenized conversations (an Arrow table of `input_ids` and `assistant_masks`), each whole in one
    window of `window` tokens, packed by best fit decreasing as TRL packs (accel_trainer/data/packing.py); the
    room a window has left is padding, marked -1 in `documents` and never the assistant's."""
    packed = packing.pack_table(rows, window, {"input_ids": pad_id, "assistant_masks": 0})
    return packed.rename_columns({"assistant_masks": "assistant"})


def packing_line(splits: dict[str, datasets.Dataset], window: int) -> str:
    """One line on what packing made of each split: its conversations, its windows and their padding share."""
    counts = []
    for name, windows in splits.items():
        marks = windows.with_format("arrow")["documents"]
        counts.append(
            f"{name} {packing.rows_packed(marks):,} into {len(windows):,} ({packing.padding_share(marks):.1%} padding)"
        )
    return f"accel-trainer: conversations packed whole in windows of {window} tokens (best fit decreasing): " + (
        ", ".join(counts)
    )


if __name__ == "__main__":
    at.main("sft_chat")
