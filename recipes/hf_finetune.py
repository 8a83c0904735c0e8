"""Fine-tune a pretrained transformers causal LM on your own text: LoRA through peft, or every weight.

    accel-trainer train hf_finetune base=HuggingFaceTB/SmolLM2-135M data=notes/ max_steps=200   # a cached hub id
    accel-trainer train hf_finetune base=model.Q8_0.gguf data=a.jsonl:0.7,b.parquet:0.3          # a GGUF file
    accel-trainer train hf_finetune base=runs/base/final max_steps=100            # a base of our own, the demo text
    accel-trainer train hf_finetune base=runs/base/final lora_r=0 lr=3e-4         # every weight
    accel-trainer train hf_finetune base=... data=... layout=cpu_fsdp             # any layout

`base=` is a `save_pretrained` folder (such as hf_causal_lm's `final/`), a hub id in the local Hugging Face cache
(HF_HUB_OFFLINE honoured), or a `.gguf` file, dequantized (accel_trainer/contract/pretrained.py). The base's own
tokenizer reads the text: each paragraph (or row) is its tokens and the base's end-of-text token, cut into examples of
at most block_size + 1 tokens (or packed: pack_sequences=true), padded with the base's padding token (its
end-of-text token when it has none); block_size may not exceed the base's context. `data=` takes text files,
folders, globs, .jsonl/.json/.parquet/.csv (text_column=), a save_to_disk folder or a cached hub dataset, and
weighted mixtures (see `--help`); without it, the demo corpus (the Python standard library's paragraphs).

With `lora_r > 0` the model is peft's LoRA of the base: only the adapter trains, and each checkpoint holds the
adapter, its optimizer state and a fingerprint of the frozen base (accel_trainer/checkpoint/frozen.py), which a
resume checks. `final/` is then the merged model, `AutoModelForCausalLM.from_pretrained(<run>/final)` with the
base's tokenizer beside it, and `final/adapter/` the adapter alone, `PeftModel.from_pretrained(base_model,
<run>/final/adapter)`; both give the same logits. FSDP shards the base's `_no_split_modules` blocks as units
without being told.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import accel_trainer as at

ByteGPT = at.get_recipe("gpt")
HFCausalLM = at.get_recipe("hf_causal_lm")
gpt_module = sys.modules[ByteGPT.__module__]
ByteTextConfig = gpt_module.ByteTextConfig  # the schedule and data fields, no model shape


ChunkedLossField = sys.modules[HFCausalLM.__module__].ChunkedLossField


@dataclass
class PretrainedBase(ChunkedLossField):  # type: ignore[valid-type,misc]
    """The fields of a fine-tune of a pretrained model (this recipe's and sft_chat's), checked when the config is
    made: a one-line error before any work, and a local base kept as an absolute path, so the run's config.yaml,
    its checkpoints and final/adapter name it from any working directory."""

    base: str = ""
    """The pretrained model: a save_pretrained folder (a run's final/), a hub id in the local Hugging Face cache,
    or a .gguf file (dequantized)."""
    lora_r: int = 8
    """Rank of the LoRA adapter on every linear layer but the output head; 0 trains every weight instead."""
    lora_alpha: float = 16.0
    """LoRA's scale numerator: the adapter's update is scaled by lora_alpha / lora_r."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input."""
    quantize_base: Literal["none", "nf4"] = "none"
    """nf4: QLoRA, the frozen base's linear weights held in 4 bits (torchao's NF4) under the LoRA adapter."""

    def __post_init__(self) -> None:
        if self.lora_r < 0:
            raise at.ConfigError(f"lora_r={self.lora_r}: must be at least 0 (0 trains every weight, no adapter)")
        if self.quantize_base != "none" and self.lora_r == 0:
            raise at.ConfigError(
                f"quantize_base={self.quantize_base} freezes the base in 4 bits, and lora_r=0 trains every weight:"
                " give lora_r > 0 (QLoRA), or quantize_base=none"
            )
        if not 0 <= self.lora_dropout < 1:
            raise at.ConfigError(f"lora_dropout={self.lora_dropout}: must be in [0, 1)")
        if self.base:
            self.base = at.check_base(self.base)
        getattr(super(), "__post_init__", lambda: None)()  # the data fields' checks


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
        """The base's own tokenizer, with its padding token (its end-of-text token when it has none)."""
        if not cfg.base:
            raise at.ConfigError(self.needs_base)
        return at.load_base_tokenizer(cfg.base)

    needs_base = "this recipe needs base=: a save_pretrained folder (a run's final/), a cached hub id or a .gguf file"

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def check_data_given(self, cfg: Any) -> None:
        """Refuse to fine-tune a real pretrained model on the built-in demo data, made for the byte-level base of
        hf_causal_lm: a forgotten data= would train it on Python's standard library and exit 0.

        Raises:
            ConfigError: no data= and a base whose tokenizer is not the demo's bytes.
        """
        if not cfg.data and not self.byte_level:
            raise at.ConfigError(
                f"base={cfg.base} is a pretrained model of its own tokenizer: give your data with data=FILE_OR_FOLDER"
                " (the built-in demo data is for the byte-level base that hf_causal_lm trains)"
            )

    def build_datasets(self, cfg: FinetuneConfig) -> tuple[Any, Any]:
        """The text (data=, else the demo corpus) in the base's own tokens."""
        tokenizer = self.tokenizer if self.tokenizer is not None else self.build_tokenizer(cfg)
        self.tokenizer = tokenizer  # byte_level reads it
        self.check_data_given(cfg)
        return gpt_module.build_splits(cfg, encode=gpt_module.TokenizerEncoding(tokenizer))

    def build_model(self, cfg: FinetuneConfig) -> Any:
        model = load_base(cfg, self.needs_base)
        context = at.base_context(model)
        if context and cfg.block_size > context:
            raise at.RecipeError(f"block_size={cfg.block_size} is longer than the base's context, {context}")
        self.packed_by_positions(model)
        return self.with_chunked_loss(with_lora(model, cfg))


def load_base(cfg: PretrainedBase, needs_base: str) -> Any:
    """The pretrained model of `cfg.base`, or a one-line error (`needs_base` without one). Under QLoRA its linear
    weights are quantized as they are read (`quantize_base=nf4`: never the whole base in full precision)."""
    if not cfg.base:
        raise at.ConfigError(needs_base)
    sys.modules[HFCausalLM.__module__].quiet_padding_advice()  # its batches, padded on the right
    try:
        model = at.load_base_model(cfg.base, quantize=cfg.quantize_base)
    except OSError as error:
        raise at.RecipeError(f"base={cfg.base} cannot be loaded: {str(error).splitlines()[0]}") from None
    if getattr(model, "loss_type", "") is None:  # a base saved without one: transformers says so at each forward
        model.loss_type = "ForCausalLM"
    return model


def with_lora(model: Any, cfg: PretrainedBase) -> Any:
    """peft's LoRA of `model` on every linear layer but the output head (lora_r > 0), over the base quantized as
    `cfg.quantize_base` says (QLoRA: `load_base` quantized it while reading it; a base built otherwise is
    quantized here), else `model` itself."""
    if cfg.lora_r == 0:
        return model
    model = at.quantize_base(model, cfg.quantize_base)
    from transformers.pytorch_utils import Conv1D

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
        raise at.RecipeError("a LoRA fine-tune (lora_r > 0) needs peft: pip install 'accel-trainer[peft]'") from error
    return peft


if __name__ == "__main__":
    at.main("hf_finetune")
