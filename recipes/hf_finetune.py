"""Fine-tune a pretrained transformers causal LM from a local folder: LoRA through peft, or every weight.

    accel-trainer train hf_causal_lm output_dir=runs/base max_steps=300          # a base of our own
    accel-trainer train hf_finetune base=runs/base/final max_steps=100           # LoRA (lora_r=8)
    accel-trainer train hf_finetune base=runs/base/final lora_r=0 lr=3e-4        # every weight
    accel-trainer train hf_finetune base=runs/base/final layout=cpu_fsdp         # any layout

The base is read with `AutoModelForCausalLM.from_pretrained(base)` (no download: a folder). With `lora_r > 0`
the model is peft's LoRA of it: only the adapter trains, and each checkpoint holds the adapter, its optimizer
state and a fingerprint of the frozen base (accel_trainer/checkpoint/frozen.py), which a resume checks.
`final/` is then the merged model, `AutoModelForCausalLM.from_pretrained(<run>/final)`, and `final/adapter/`
the adapter alone, `PeftModel.from_pretrained(base_model, <run>/final/adapter)`; both give the same logits.
FSDP shards the base's `_no_split_modules` blocks (GPT2Block) as units without being told.

The data, batches, loss and eval are hf_causal_lm's (bytes of the Python standard library), so the base must
be a byte-level model such as hf_causal_lm's `final/`; block_size may not exceed the base's context.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import accel_trainer as at

ByteGPT = at.get_recipe("gpt")
HFCausalLM = at.get_recipe("hf_causal_lm")
ByteTextConfig = sys.modules[ByteGPT.__module__].ByteTextConfig  # the schedule and data fields, no model shape


@dataclass
class PretrainedBase:
    """The fields of a fine-tune of a local pretrained model (this recipe's and sft_chat's), checked when the
    config is made: a one-line error before any work, and the base's folder kept as an absolute path, so the
    run's config.yaml, its checkpoints and final/adapter name it from any working directory."""

    base: str = ""
    """The pretrained model: a folder `AutoModelForCausalLM.from_pretrained` reads (a run's final/)."""
    lora_r: int = 8
    """Rank of the LoRA adapter on every linear layer but the output head; 0 trains every weight instead."""
    lora_alpha: float = 16.0
    """LoRA's scale numerator: the adapter's update is scaled by lora_alpha / lora_r."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input."""

    def __post_init__(self) -> None:
        if self.lora_r < 0:
            raise at.ConfigError(f"lora_r={self.lora_r}: must be at least 0 (0 trains every weight, no adapter)")
        if not 0 <= self.lora_dropout < 1:
            raise at.ConfigError(f"lora_dropout={self.lora_dropout}: must be in [0, 1)")
        if not self.base:
            return
        folder = Path(self.base).expanduser()
        if not (folder / "config.json").is_file() and (folder / "final" / "config.json").is_file():
            raise at.ConfigError(f"base={self.base} is a run folder; its model is base={folder / 'final'}")
        if not (folder / "config.json").is_file():
            raise at.ConfigError(
                f"base={self.base} is not a pretrained model's folder (no {folder / 'config.json'}): give a folder"
                " that save_pretrained wrote, such as a run's final/"
            )
        self.base = str(folder.resolve())


@dataclass
class FinetuneConfig(PretrainedBase, ByteTextConfig):  # type: ignore[valid-type,misc]
    max_steps: int = 100
    lr: float = 1e-3
    warmup_steps: int = 10
    block_size: int = 64
    own_loss: bool = False
    """As in hf_causal_lm: the model's own out.loss from labels instead of at.token_cross_entropy."""


@at.register_recipe("hf_finetune")
class HFFinetune(HFCausalLM):  # type: ignore[valid-type,misc]
    """A local pretrained causal LM, fine-tuned with a LoRA adapter (peft) or in full."""

    Config = FinetuneConfig
    wrap_classes = ()  # the framework takes the base's _no_split_modules

    def build_tokenizer(self, cfg: FinetuneConfig) -> Any:
        """The base's tokenizer (its folder's tokenizer.json), else hf_causal_lm's byte tokenizer."""
        if cfg.base and (Path(cfg.base) / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(cfg.base)
        return super().build_tokenizer(cfg)

    def build_model(self, cfg: FinetuneConfig) -> Any:
        if not cfg.base:
            raise at.ConfigError("this recipe needs base=FOLDER: a pretrained model's folder (a run's final/)")
        from transformers import AutoModelForCausalLM
        from transformers.pytorch_utils import Conv1D

        sys.modules[HFCausalLM.__module__].quiet_padding_advice()  # its batches, padded on the right
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.base)
        except OSError as error:
            raise at.RecipeError(f"base={cfg.base} cannot be loaded: {str(error).splitlines()[0]}") from None
        if getattr(model, "loss_type", "") is None:  # a base saved without one: transformers says so at each forward
            model.loss_type = "ForCausalLM"
        context = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", 0)
        if context and cfg.block_size > context:
            raise at.RecipeError(f"block_size={cfg.block_size} is longer than the base's context, {context}")
        if cfg.lora_r == 0:
            return model
        peft = _peft()
        lora = peft.LoraConfig(
            r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules="all-linear",
            fan_in_fan_out=any(isinstance(module, Conv1D) for module in model.modules()), task_type="CAUSAL_LM",
        )  # fmt: skip
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, lora)


def _peft() -> Any:
    """The peft package, or a one-line error saying how to install it."""
    try:
        import peft
    except ImportError as error:
        raise at.RecipeError(
            "recipe hf_finetune with lora_r > 0 needs peft: pip install 'accel-trainer[peft]'"
        ) from error
    return peft


if __name__ == "__main__":
    at.main("hf_finetune")
