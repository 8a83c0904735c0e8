"""Online RL of a pretrained causal LM with GRPO: completions sampled from the current weights, scored by your
reward functions, the policy trained on each group's advantages (TRL's GRPOTrainer, loss `dapo` by default).

    accel-trainer train grpo base=SmolLM2-135M-Instruct.Q4_1.gguf              # the demo: arithmetic, 2 rewards
    accel-trainer train grpo base=... data=prompts.jsonl rewards=my_rewards.py:correct,my_rewards.py:formatted
    accel-trainer train grpo base=... data=... rewards=... reward_weights=1,0.2 num_generations=8 beta=0.04

Data (`data=`, any form of data/sources.py): rows with `prompt`, text or a conversation (a list of messages,
rendered with the base's chat template and its generation prompt), and any other columns, which reach the reward
functions as keyword lists (contract/rewards.py: TRL's signature `fn(prompts, completions, **columns)`).
`global_batch_size` and `micro_batch_size` count prompts; each brings `num_generations` completions, a group,
which is never split across processes or micro-batches. A group is sampled alone (contract/group_sampling.py),
its draws seeded by (seed, step, the prompt's row), so every layout samples the same completions and trains to the
same weights (contract/policy_gradient.py: the loss types' normalisers are the loop's exact num_items). What a run
logs (TRL's figures) and writes (completions.jsonl, answers.md): docs/grpo.md.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import datasets
import torch
from accelerate import PartialState
from accelerate.utils import gather, gather_object

import accel_trainer as at
from accel_trainer.contract import group_sampling, policy_gradient, rewards
from accel_trainer.contract.answers import answers_page, disable_dropout, greedy_answer, shortened
from accel_trainer.contract.reference import policy_of
from accel_trainer.data import arithmetic, chat

HFFinetune = at.get_recipe("hf_finetune")
finetune_module = sys.modules[HFFinetune.__module__]
gpt_module = sys.modules[at.get_recipe("gpt").__module__]
PROMPT_FORMS = [{"prompt": "prompt"}]
IGNORE_INDEX = -100
DEMO_REWARDS = "accel_trainer.data.arithmetic:correct,accel_trainer.data.arithmetic:short"


@dataclass
class GRPOConfig(finetune_module.PretrainedBase, at.TrainConfig):  # type: ignore[valid-type,misc]
    max_steps: int = 40
    global_batch_size: int = 4
    """Prompts a step, each with num_generations completions."""
    micro_batch_size: int = 1
    """Prompts a micro-batch."""
    lr: float = 2e-5
    warmup_steps: int = 0
    log_every_steps: int = 1
    eval_every_steps: int = 0
    save_every_steps: int = 20
    data: str = ""
    """Your prompts: rows with `prompt` (text or messages) and any columns the rewards read. Empty: the demo."""
    rewards: str = ""
    """The reward functions, FILE.py:function or module:function, comma-separated. Empty: the demo's."""
    reward_weights: str = ""
    """Each reward function's weight, comma-separated; empty: 1 each."""
    chat_template: str = ""
    """The chat template of conversational prompts: empty for the base's own, chatml, or a .jinja file."""
    num_generations: int = 8
    """Completions sampled per prompt (TRL's default 8)."""
    max_completion_length: int = 256
    """Tokens a completion may have (TRL's default 256); one without an end-of-sequence token is cut there."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut (TRL's default)."""
    steps_per_generation: int = 1
    """Optimizer steps one generation feeds: the rollout samples their prompts together, each step trains on its
    share (TRL counts micro-batches, by default its gradient_accumulation_steps: one optimizer step, as here)."""
    num_iterations: int = 1
    """Passes over each generation (TRL's num_iterations, the paper's mu): above 1, or with steps_per_generation
    above 1, the ratio to the sampling weights' log-probabilities is clipped at epsilon."""
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"
    """TRL's loss types (contract/policy_gradient.py); dapo: token-level over the step's tokens."""
    epsilon: float = 0.2
    """The ratio's clip below 1 (and above, without epsilon_high)."""
    epsilon_high: float = 0.0
    """The ratio's clip above 1 (DAPO's clip-higher); 0: epsilon."""
    beta: float = 0.0
    """Weight of the KL to the reference, the base: the adapter disabled, or in full (lora_r=0) a frozen copy of
    it (at.PolicyAndReference, as dpo's); 0 (TRL's default): no reference."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """The deviation advantages are divided by: the group's (TRL's default), the whole step's, or none."""
    disable_dropout: bool = True
    """Dropout off in the model, as TRL's GRPOTrainer does by default."""
    demo_prompts: int = 2000
    """The demo's number of arithmetic prompts."""
    held_out: int = 5
    """Prompts kept out of training, answered greedily before and after it in answers.md."""
    split_seed: int = 1234
    """Seed of the choice of held-out prompts."""
    max_answer_chars: int = 160
    """answers.md shows its answers (max_completion_length tokens, scored whole) cut at this many characters."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.data, _ = at.check_data(self.data, "")
        self.rewards = rewards.absolute_files(self.rewards)
        self.chat_template = chat.check_template_choice(self.chat_template)
        if self.num_generations < 2:
            raise at.ConfigError(f"num_generations={self.num_generations}: a group needs 2 or more completions")
        for name in ("steps_per_generation", "num_iterations"):
            if getattr(self, name) < 1:
                raise at.ConfigError(f"{name}={getattr(self, name)}: give 1 or more")
        if self.max_completion_length < 1:
            raise at.ConfigError(f"max_completion_length={self.max_completion_length}: give 1 or more tokens")
        if self.data and not self.rewards:
            raise at.ConfigError("data= without rewards=: name your reward functions, rewards=FILE.py:function")


@at.register_recipe("grpo")
class GRPO(at.Recipe):
    """A pretrained causal LM trained online on its own completions' rewards (GRPO), with LoRA or in full."""

    Config = GRPOConfig
    needs_base = HFFinetune.needs_base
    held_out_rows: Any = None  # build_datasets's, for answers.md

    def build_tokenizer(self, cfg: GRPOConfig) -> Any:
        if not cfg.base:
            raise at.ConfigError(self.needs_base)
        tokenizer = at.load_base_tokenizer(cfg.base)
        if cfg.chat_template or getattr(tokenizer, "chat_template", None):
            chat.resolve_template(tokenizer, cfg.chat_template)
        self.functions = rewards.reward_functions(cfg.rewards or DEMO_REWARDS)
        self.weights = rewards.reward_weights(cfg.reward_weights, len(self.functions))
        return tokenizer

    def build_model(self, cfg: GRPOConfig) -> Any:
        model = at.with_chunked_loss(finetune_module.with_lora(finetune_module.load_base(cfg, self.needs_base), cfg))
        if cfg.disable_dropout:  # the adapter's lora_dropout too, as TRL's disable_dropout_in_model does
            disable_dropout(model)
        return at.PolicyAndReference(model) if cfg.beta and cfg.lora_r == 0 else model  # the KL's reference

    def build_datasets(self, cfg: GRPOConfig) -> tuple[datasets.Dataset, None]:
        """The prompts with their row's index (the sampling key's) and their tokens; the other columns as given."""
        if cfg.data:
            with gpt_module._quiet_datasets():
                rows = at.read_data(cfg.data, PROMPT_FORMS, streaming=False, seed=cfg.seed, others=True)
        else:
            rows = datasets.Dataset.from_list(arithmetic.prompts(cfg.demo_prompts, cfg.seed))
        tokenizer = self.tokenizer

        def tokenized(row: dict[str, Any], index: int) -> dict[str, Any]:
            prompt = row["prompt"]
            if isinstance(prompt, list):
                ids = chat.render_ids(tokenizer, prompt, generation_prompt=True)
            else:
                ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            return {"prompt_ids": ids, "row": index}

        if cfg.held_out:
            if len(rows) - cfg.held_out < cfg.global_batch_size:
                raise at.ConfigError(
                    f"held_out={cfg.held_out} of {len(rows)} prompts leaves {max(0, len(rows) - cfg.held_out)} to train"
                    f" on, fewer than global_batch_size={cfg.global_batch_size}: lower held_out (0: no answers.md)"
                )
            split = rows.train_test_split(test_size=cfg.held_out, seed=cfg.split_seed)
            rows, self.held_out_rows = split["train"], split["test"]
        with gpt_module._quiet_datasets():
            return rows.map(tokenized, with_indices=True), None

    def write_artifacts(self, model: Any, eval_dataset: Any, run_dir: Any) -> None:
        """`answers.md`: the held-out prompts' greedy answers before training (the base: the adapter disabled) and
        after it, with each reward function's score of them."""
        if self.held_out_rows is None:
            return
        rows = list(self.held_out_rows)
        after = [self.answer(model, row["prompt"]) for row in rows]
        before = None
        if hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                before = [self.answer(model, row["prompt"]) for row in rows]
        answered = [
            (row["prompt"], [f"{when}: {shortened(answers[index], self.cfg.max_answer_chars)!r} "
                             f"{self.scored(row, answers[index])}"
                             for when, answers in (("before", before), ("after", after)) if answers is not None])
            for index, row in enumerate(rows)
        ]  # fmt: skip
        note = "(A full fine-tune keeps no base to answer before training: the trained model only.)"
        note = "" if before is not None else note
        title = "Held-out prompts, answered before and after training (greedy)"
        (run_dir / "answers.md").write_text(answers_page(title, answered, note))

    def answer(self, model: Any, prompt: Any) -> str:
        """The greedy completion, as long as a training completion may be (the rewards score it whole, as they
        score training's; answers.md shows it cut at max_answer_chars)."""
        return greedy_answer(model, self.tokenizer, prompt, sys.maxsize, self.cfg.max_completion_length)

    def scored(self, row: dict[str, Any], answer: str) -> str:
        """The reward functions' scores of one answer, as `(name 1.0, ...)`."""
        completion = [{"role": "assistant", "content": answer}] if isinstance(row["prompt"], list) else answer
        columns = {name: [value] for name, value in row.items() if name != "prompt"}
        table = rewards.scores(self.functions, [row["prompt"]], [completion], **columns)
        return (
            "(" + ", ".join(f"{f.name} {v:.3g}" for f, v in zip(self.functions, table[0].tolist(), strict=True)) + ")"
        )

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """The prompts as they are (unpadded token ids, each sampled alone) and every column as a list of Python
        values, as TRL hands them to reward functions (the loader's torch format made numbers tensors)."""
        batch: dict[str, Any] = {name: [plain(example[name]) for example in examples] for name in examples[0]}
        batch["prompt_ids"] = [torch.as_tensor(example["prompt_ids"]) for example in examples]
        batch["row"] = torch.tensor([example["row"] for example in examples])
        return batch

    def rollout_schedule(self) -> tuple[int, int]:
        return self.cfg.steps_per_generation, self.cfg.num_iterations

    def rollout(self, model: Any, batches: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """Each prompt's group sampled and scored, the generation's advantages, and the sequences compute_loss trains
        on (contract/group_sampling.py, contract/rewards.py, contract/policy_gradient.py). `batches`: the micro-batches
        of the steps_per_generation steps from `step` on."""
        cfg = self.cfg
        self.shown: list[dict[str, Any]] = []  # the generation's completions, for completions.jsonl
        sampled = [self.sampled(model, batch, step) for batch in batches]
        every_reward = gather(torch.cat([made["rewards"] for made in sampled]).to(batches[0]["row"].device)).cpu()
        reward_std = policy_gradient.nan_std(every_reward)  # all processes': the generation's spread
        for made in sampled:
            made["advantages"] = at.group_advantages(
                made["rewards"], num_generations=cfg.num_generations, scale_rewards=cfg.scale_rewards,
                step_rewards=every_reward,
            )  # fmt: skip
            made["reward_std"] = reward_std
        fed = range(step, step + cfg.steps_per_generation * cfg.num_iterations)  # the steps this generation feeds
        if step == 1 or any(cfg.log_every_steps and later % cfg.log_every_steps == 0 for later in fed):
            self.write_completions(step, [made["advantages"] for made in sampled])
        return sampled

    def write_completions(self, step: int, advantages: list[torch.Tensor]) -> None:
        """The generation's prompts, completions, rewards and advantages, every process's, appended to the run
        folder's completions.jsonl by the main process (TRL's completions table), under its first step."""
        for row, advantage in zip(self.shown, torch.cat(advantages).tolist(), strict=True):
            row["advantage"] = advantage
        rows = gather_object(self.shown)
        if PartialState().is_main_process and self.run_dir is not None:
            with (self.run_dir / "completions.jsonl").open("a") as file:
                file.writelines(json.dumps({"step": step, **row}, default=str) + "\n" for row in rows)

    def sampled(self, model: Any, batch: dict[str, Any], step: int) -> dict[str, Any]:
        """One micro-batch's groups: completions, rewards, and the right-padded sequences of prompt + completion,
        with the log-probabilities the loss compares against: the reference's (beta > 0) and, where the generation
        feeds more than one step, the sampling weights'."""
        cfg = self.cfg
        groups = self.groups(model, batch, step)
        table = rewards.scores(self.functions, groups.prompts, groups.completions, **groups.columns)
        names = [function.name for function in self.functions]
        for prompt, completion, scores in zip(groups.prompts, groups.completions, table.tolist(), strict=True):
            self.shown.append(
                {"prompt": prompt, "completion": completion, "rewards": dict(zip(names, scores, strict=True))}
            )
        inputs = group_sampling.right_padded(groups.sequences, groups.masks, self.tokenizer.pad_token_id)
        targets = at.completion_targets(inputs["input_ids"], inputs["completion_mask"])
        if cfg.beta and cfg.lora_r:  # the reference: the base, the adapter disabled (a full copy's: in the step)
            with model.disable_adapter():
                inputs["ref_logps"] = -token_losses(model, inputs, targets)
        if cfg.steps_per_generation * cfg.num_iterations > 1:  # later steps train other weights on these
            inputs["old_logps"] = -token_losses(policy_of(model), inputs, targets)
        return {
            **inputs,
            "rewards": rewards.weighted(table, self.weights),
            "per_function": table,
            "completion_lengths": torch.tensor(groups.lengths, dtype=torch.float64),
        }

    def groups(self, model: Any, batch: dict[str, Any], step: int) -> SampledGroups:
        """The micro-batch's prompts' groups, sampled with the key (seed, step, the prompt's row), each completion
        beside its prompt, its prompt's columns and its sequence of prompt + completion tokens."""
        cfg, tokenizer, made, policy = self.cfg, self.tokenizer, SampledGroups(), policy_of(model)
        synced = any(type(parameter).__name__ == "DTensor" for parameter in model.parameters())
        for position, prompt_ids in enumerate(batch["prompt_ids"]):
            group = group_sampling.sample_group(
                policy, prompt_ids, num_generations=cfg.num_generations,
                max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                top_k=cfg.top_k, eos_token_ids=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id, key=(cfg.seed, step, int(batch["row"][position])), synced=synced,
            )  # fmt: skip
            prompt = batch["prompt"][position]
            for ids, mask in zip(group.completion_ids, group.completion_mask, strict=True):
                kept = ids[: int(mask.sum())]
                made.sequences.append(torch.cat([prompt_ids, kept]))
                made.masks.append(torch.cat([torch.zeros_like(prompt_ids), torch.ones_like(kept)]))
                made.lengths.append(len(kept))
                text = tokenizer.decode(kept, skip_special_tokens=True)
                made.prompts.append(prompt)
                made.completions.append([{"role": "assistant", "content": text}] if isinstance(prompt, list) else text)
                for name, values in batch.items():
                    if name not in ("prompt", "prompt_ids", "row"):
                        made.columns.setdefault(name, []).append(values[position])
        return made

    def compute_loss(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """GRPO's loss of the micro-batch's completions (the tokens' log-probabilities in chunks, never the
        vocabulary's logits of the whole batch), with what it logs as terms of their own counts."""
        cfg = self.cfg
        targets = at.completion_targets(batch["input_ids"], batch["completion_mask"])
        inputs, ref_logps = model_inputs(batch), batch.get("ref_logps")
        if cfg.beta and not cfg.lora_r:  # the policy and its frozen copy in one forward (contract/reference.py)
            head_loss = at.HeadLoss(targets, per_token=True, entropy=True)
            (losses, entropies), (ref_losses, _) = at.policy_and_reference(model, **inputs, head_loss=head_loss)
            ref_logps = -ref_losses
        else:
            losses, entropies = at.lm_token_losses_and_entropies(model, inputs, targets)
        mask = targets != IGNORE_INDEX
        output = at.policy_gradient_loss(
            -losses, mask, batch["advantages"], loss_type=cfg.loss_type, old_logps=batch.get("old_logps"),
            epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high or cfg.epsilon, beta=cfg.beta,
            ref_logps=ref_logps, max_completion_length=cfg.max_completion_length,
        )  # fmt: skip
        names = [function.name for function in self.functions]
        entropy = {"entropy": (entropies.sum(), mask.sum().float())}  # TRL's: the mean over completion tokens
        return {**output, **rewards.logged_figures(batch, names, self.cfg.num_generations), **entropy}


@dataclass
class SampledGroups:
    """A micro-batch's completions, one entry each, in its prompts' order."""

    sequences: list[torch.Tensor] = field(default_factory=list)  # prompt + completion tokens
    masks: list[torch.Tensor] = field(default_factory=list)  # 1 on the completion's tokens
    lengths: list[int] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    completions: list[Any] = field(default_factory=list)  # text, or a conversation's assistant message
    columns: dict[str, list[Any]] = field(default_factory=dict)  # the prompt's other columns, for the rewards


def plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


def token_losses(model: Any, batch: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Each position's loss of its target (0 where ignored), in chunks of the output head (at.lm_token_losses)."""
    return at.lm_token_losses(model, model_inputs(batch), targets)


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model's forward takes of a micro-batch (its other tensors are the loss's)."""
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


if __name__ == "__main__":
    at.main("grpo")
