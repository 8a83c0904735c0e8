"""Preference tuning of a pretrained causal LM on chosen/rejected pairs: DPO, or the reference-free SimPO.

    accel-trainer train dpo base=runs/sft/final data=pairs.jsonl                    # LoRA (lora_r=8), DPO
    accel-trainer train dpo base=runs/sft/final data=pairs.jsonl lora_r=0 lr=5e-6   # every weight
    accel-trainer train dpo base=... data=pairs.jsonl loss=simpo beta=2.0           # SimPO: no reference
    accel-trainer train dpo base=... data=pairs.jsonl precompute_ref=true layout=cpu_fsdp
    accel-trainer sample runs/dpo --chat --prompt "What does json.dumps do?"
    accel-trainer train hf_causal_lm output_dir=runs/base max_steps=600     # the demo: a base of our own, chat
    accel-trainer train sft_chat base=runs/base/final output_dir=runs/sft   # fine-tuned on the stdlib's questions,
    accel-trainer train dpo base=runs/sft/final output_dir=runs/dpo         # then taught their right answers

Data (`data=`, any form of data/sources.py): rows of `prompt`, `chosen`, `rejected`, as TRL takes them: lists of
messages (through the base's chat template, or `chat_template=`), or plain text (an end-of-sequence token appended
to each completion); without `prompt`, what chosen and rejected begin with alike (accel_trainer/data/
preference_pairs.py). `eval_data=` is the held-out set, else an eval_fraction of the pairs. Without data=, the
demo: each question of sft_chat's demo, "What does <module>.<name> do?", with its docstring's first sentence
chosen and that answer cut short rejected; its held-out questions are those sft_chat's demo held out.

Loss (`loss=`): `dpo`, TRL's sigmoid DPO with `beta`, against a reference: the base itself, which is the adapter
disabled under LoRA, a frozen copy of the base in full (`at.PolicyAndReference`: sharded like the policy, kept
out of checkpoints and fingerprinted), or, with `precompute_ref=true`, its log-probabilities computed once before
training and cached (accel_trainer/data/reference_logps.py). `simpo`: SimPO, reference-free, on the average
log-probability per token with the margin `simpo_gamma`. Logged as TRL logs them: `loss`, `rewards/chosen`,
`rewards/rejected`, `rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected`, exact means over
each optimizer step's pairs, and the same of the held-out pairs (`eval/rewards/accuracies`: the share whose
chosen completion the tuned model prefers over the reference more than the rejected one). `final/` is the tuned
model (LoRA merged, and `final/adapter/`) with the base's tokenizer; `answers.md` its answers to held-out prompts
beside both completions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import datasets
import torch

import accel_trainer as at
from accel_trainer.contract.answers import answers_page, disable_dropout, greedy_answer
from accel_trainer.contract.preference import token_losses_of_logits
from accel_trainer.data import chat, preference_pairs, reference_logps

HFFinetune = at.get_recipe("hf_finetune")
SFTChat = at.get_recipe("sft_chat")
finetune_module, sft_module = sys.modules[HFFinetune.__module__], sys.modules[SFTChat.__module__]
gpt_module = sys.modules[at.get_recipe("gpt").__module__]
PretrainedBase = finetune_module.PretrainedBase
TRL_MAX_LENGTH = 1024


@dataclass
class DPOConfig(PretrainedBase, at.TrainConfig):  # type: ignore[valid-type,misc]
    max_steps: int = 200
    global_batch_size: int = 16
    micro_batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 10
    log_every_steps: int = 10
    eval_every_steps: int = 50
    data: str = ""
    """Your pairs: rows of prompt, chosen, rejected (messages or text), in any form data= takes. Empty: the demo."""
    eval_data: str = ""
    """Held-out pairs, in data's forms; empty: eval_fraction of the pairs is held out."""
    chat_template: str = ""
    """The chat template of conversational pairs: empty for the base's own, chatml, or a .jinja file."""
    loss: Literal["dpo", "simpo"] = "dpo"
    """dpo: TRL's sigmoid DPO against the reference; simpo: SimPO, reference-free (average log-probabilities)."""
    beta: float = 0.1
    """DPO's beta (TRL's default 0.1): how far the policy may move from the reference; SimPO's beta (its paper
    uses 2 to 2.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (TRL's default 0.5)."""
    precompute_ref: bool = False
    """Compute the reference's log-probabilities of every pair once before training, cached and checked on resume:
    no reference forward per step, and no reference copy in a full fine-tune."""
    max_length: int = 0
    """Tokens per sequence (prompt and completion), longer ones cut as `truncation` says; 0: TRL's 1024, or the
    base's context where it is shorter."""
    truncation: Literal["keep_start", "keep_end"] = "keep_start"
    """Which end of a long sequence stays (TRL's truncation_mode); keep_start drops a pair whose prompt fills it."""
    disable_dropout: bool = True
    """Dropout off in the model, as TRL's DPOTrainer does by default (its log-probabilities are then exact)."""
    eval_fraction: float = 0.05
    """Fraction of the pairs held out for evaluation (without eval_data); 0 holds none out."""
    split_seed: int = 1234
    """Seed of the train/eval split (the demo's is sft_chat's, so its held-out questions are new to both)."""
    max_answer_chars: int = 160
    """As sft_chat's: the demo's answers cut to at most this many characters."""
    max_source_bytes: int = 2_000_000
    """As sft_chat's: the stdlib files whose docstrings make the demo's questions."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.data, self.eval_data = at.check_data(self.data, self.eval_data)
        self.chat_template = chat.check_template_choice(self.chat_template)
        if self.beta <= 0:
            raise at.ConfigError(f"beta={self.beta}: must be above 0")
        if self.max_length < 0 or self.max_length == 1:
            raise at.ConfigError(f"max_length={self.max_length}: give 2 or more tokens (0: TRL's 1024)")
        if not 0 <= self.eval_fraction < 1:
            raise at.ConfigError(f"eval_fraction={self.eval_fraction}: must be in [0, 1)")
        if self.precompute_ref and self.loss == "simpo":
            raise at.ConfigError("precompute_ref=true with loss=simpo: SimPO has no reference; leave precompute_ref")


@at.register_recipe("dpo")
class DPO(at.Recipe):
    """A pretrained causal LM tuned on preference pairs (DPO or SimPO), with LoRA or in full."""

    Config = DPOConfig
    needs_base = HFFinetune.needs_base

    def build_tokenizer(self, cfg: DPOConfig) -> Any:
        """The base's own tokenizer, with the chosen chat template (else its own, if it has one); and the
        sequences' max_length, from the base's context (built first, before the model and the data)."""
        if not cfg.base:
            raise at.ConfigError(self.needs_base)
        tokenizer = at.load_base_tokenizer(cfg.base)
        if cfg.chat_template or getattr(tokenizer, "chat_template", None):
            chat.resolve_template(tokenizer, cfg.chat_template)
        self.max_length = resolved_max_length(cfg)
        return tokenizer

    def build_model(self, cfg: DPOConfig) -> Any:
        """The base with dropout off; LoRA of it, or the policy with a frozen reference copy (a full DPO without
        precomputed reference log-probabilities)."""
        model = at.with_chunked_loss(finetune_module.with_lora(finetune_module.load_base(cfg, self.needs_base), cfg))
        if cfg.disable_dropout:  # the adapter's lora_dropout too, as TRL's disable_dropout_in_model does
            disable_dropout(model)
        needs_copy = cfg.lora_r == 0 and cfg.loss == "dpo" and not cfg.precompute_ref
        return at.PolicyAndReference(model) if needs_copy else model

    max_length = TRL_MAX_LENGTH  # build_tokenizer's, from the base's context

    def build_datasets(self, cfg: DPOConfig) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        tokenizer = self.tokenizer
        raw = pair_splits(cfg)
        self.held_out_rows = raw["test"].select(range(min(5, len(raw["test"])))) if "test" in raw else None
        keep = cfg.truncation.removeprefix("keep_")
        with gpt_module._quiet_datasets():
            names = {"train": "training", "test": "held-out"}
            splits = {
                split: preference_pairs.tokenized_pairs(rows, tokenizer, names[split], self.max_length, keep)
                for split, rows in raw.items()
            }  # fmt: skip
            if cfg.precompute_ref:
                batch = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else 8
                batching = (
                    f"max_length={self.max_length} truncation={cfg.truncation} dropout={not cfg.disable_dropout}"
                    " loss=chunked"
                )
                base = self.build_reference(cfg)
                splits, key = reference_logps.with_reference_logps(splits, base, self.collate, batch, batching)
                self.data_fingerprints["reference_logps"] = key
        if len(splits["train"]) == 0:
            raise at.ConfigError(f"no training pair is left (max_length={self.max_length}): raise max_length")
        return splits["train"], splits.get("test")

    def build_reference(self, cfg: DPOConfig) -> Any:
        """The reference model, for precomputed log-probabilities: the base (what a LoRA's disabled adapter leaves,
        and what a full fine-tune starts from), in 4 bits under QLoRA as the policy's."""
        model = at.quantize_base(finetune_module.load_base(cfg, self.needs_base), cfg.quantize_base)
        return disable_dropout(model) if cfg.disable_dropout else model

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        keep = self.cfg.truncation.removeprefix("keep_")
        return preference_pairs.collate_pairs(examples, self.tokenizer.pad_token_id, self.max_length, keep)

    def compute_loss(self, model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return at.preference_loss(self.eval_metrics(model, batch))

    def eval_metrics(self, model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each pair's loss and TRL's metrics (at.preference_terms): per pair, exact means over the held-out pairs;
        summed with their count, the training loss."""
        cfg = self.cfg
        return at.preference_terms(
            *self.pair_logps(model, batch), beta=cfg.beta, loss=cfg.loss, simpo_gamma=cfg.simpo_gamma
        )

    def pair_logps(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        """The policy's log-probabilities of each pair's chosen and rejected completions (sums; SimPO's averages),
        and the reference's: from its forward, precomputed in the batch, or none (SimPO). Each from the tokens'
        losses in chunks (at.lm_token_losses; with chunked_loss=false, from the logits)."""
        cfg, flat = self.cfg, preference_pairs.sequences(batch)
        ids, targets = flat["input_ids"], at.completion_targets(flat["input_ids"], flat["completion_mask"])
        inputs = {"input_ids": ids, "attention_mask": flat["attention_mask"], "use_cache": False}
        if cfg.chunked_loss:
            inputs["head_loss"] = at.HeadLoss(targets, per_token=True)
        if cfg.loss == "simpo" or "ref_chosen_logps" in batch:  # no reference forward
            output, reference = model(**inputs), (batch.get("ref_chosen_logps"), batch.get("ref_rejected_logps"))
        else:
            output, reference_output = at.policy_and_reference(model, **inputs)
            reference = self.logps(reference_output, targets).chunk(2)
        chosen, rejected = self.logps(output, targets, average=cfg.loss == "simpo").chunk(2)
        return chosen, rejected, *reference

    def logps(self, output: Any, targets: torch.Tensor, average: bool = False) -> torch.Tensor:
        """Each sequence's log-probability of its targets from a forward's output: its tokens' losses
        (chunked_loss), or its logits."""
        losses = output if self.cfg.chunked_loss else token_losses_of_logits(output.logits, targets)
        return at.sequence_logps(losses, targets, average=average)

    def write_artifacts(self, model: Any, eval_dataset: Any, run_dir: Path) -> None:
        """`answers.md`: the model's greedy answers to the first held-out prompts, beside their chosen and
        rejected completions."""
        if self.held_out_rows is None:
            return
        answered = [
            (row["prompt"], [f"model: {greedy_answer(model, self.tokenizer, row['prompt'], self.cfg.max_answer_chars)}",
                             f"chosen: {text_of(row['chosen'])}", f"rejected: {text_of(row['rejected'])}"])
            for row in map(preference_pairs.with_prompt, self.held_out_rows)
        ]  # fmt: skip
        (run_dir / "answers.md").write_text(answers_page("Answers to held-out prompts", answered))

    held_out_rows: datasets.Dataset | None = None


def resolved_max_length(cfg: DPOConfig) -> int:
    """max_length, or TRL's 1024 where the base's context is no shorter; one line if it exceeds the context.

    Raises:
        RecipeError: max_length is longer than the base's context.
    """
    context = at.base_config_context(cfg.base)
    if cfg.max_length and context and cfg.max_length > context:
        raise at.RecipeError(f"max_length={cfg.max_length} is longer than the base's context, {context}: give less")
    return cfg.max_length or min(TRL_MAX_LENGTH, context or TRL_MAX_LENGTH)


def pair_splits(cfg: DPOConfig) -> dict[str, datasets.Dataset]:
    """The pairs' rows, "train" and, unless none is held out, "test": eval_data=, else an eval_fraction of the rows
    (split_seed). Without data=, the demo's pairs."""
    if not cfg.data:
        rows = datasets.Dataset.from_list(demo_pairs(cfg.max_source_bytes, cfg.max_answer_chars))
    else:
        with gpt_module._quiet_datasets():
            rows = at.read_data(cfg.data, preference_pairs.FORMS, streaming=False, seed=cfg.seed)
    if cfg.eval_data:
        held_out = at.read_data(cfg.eval_data, preference_pairs.FORMS, streaming=False, seed=cfg.seed)
        return {"train": rows, "test": held_out}
    if cfg.eval_fraction == 0:
        return {"train": rows}
    return dict(rows.train_test_split(test_size=cfg.eval_fraction, seed=cfg.split_seed))


def demo_pairs(max_source_bytes: int, max_answer_chars: int) -> list[dict[str, Any]]:
    """sft_chat's demo questions, in its order (so that a split with its seed holds out the same ones), each with
    its whole answer chosen and the answer cut short (its first half of words, of characters for one word) and
    ended, rejected: a preference for finished answers, which holds for questions never seen."""
    pairs = []
    for question, answer in sft_module.stdlib_questions(max_source_bytes, max_answer_chars):
        words = answer["content"].split()
        cut = " ".join(words[: len(words) // 2]) if len(words) > 1 else answer["content"][: len(answer["content"]) // 2]
        pairs.append({"prompt": [question], "chosen": [answer], "rejected": [{"role": "assistant", "content": cut}]})
    return pairs


def text_of(completion: Any) -> str:
    return " ".join(message["content"] for message in completion) if isinstance(completion, list) else completion


if __name__ == "__main__":
    at.main("dpo")
