"""A Hugging Face `transformers` GPT-2, built from a config (random init, no download), on the GPT recipe's bytes.

    python recipes/hf_causal_lm.py max_steps=100
    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml recipes/hf_causal_lm.py max_steps=100
    python -c 'from transformers import AutoModelForCausalLM as M; print(M.from_pretrained("<run>/final"))'

The data, collation and eval are the `gpt` recipe's (paragraphs of the Python standard library as bytes,
padded at the end of each sequence); the model is `GPT2LMHeadModel`. What is specific to transformers:
- `compute_loss` returns `at.lm_loss(model, inputs, targets)`: the output head and its cross-entropy in chunks of
  the tokens that count, never the whole vocabulary's logits (accel_trainer/contract/lm_loss.py), a sum over
  tokens with their count, exact under accumulation on any layout; `chunked_loss=false` takes the logits instead
  (`at.token_cross_entropy(out.logits, targets)`, the same loss within 1e-6). With `own_loss=true` it returns the
  model's own `out.loss` from `labels`, which the loop makes exact too by passing the step's token count as
  `num_items_in_batch`, as the HF Trainer does (accel_trainer/hf_loss.py).
- `pack_sequences=true` gives the model each token's position in its paragraph and keeps attention within each
  paragraph (`model_inputs`), so packed paragraphs never attend to each other, as in the GPT recipe: by the
  positions alone, or with a 4-D mask in the form the model's attention takes, the first form that a probe of the
  model finds exact when it is built (`Packing`, `measured_packing`).
- `wrap_classes = (GPT2Block,)`: FSDP shards each decoder block as a unit; `activation_checkpointing=true`
  uses the model's own `gradient_checkpointing_enable()` with `use_cache=False`.
- `final/` is a `save_pretrained` folder, so `from_pretrained(<run>/final)` loads the trained model, and
  `AutoTokenizer.from_pretrained(<run>/final)` its tokenizer (`build_tokenizer`: one id per byte).
Expect the same curve as `gpt` at the same size: eval bits per byte from about 8 down to about 3 by step 200.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import accel_trainer as at
from accel_trainer.contract.preference import token_losses_of_logits

ByteGPT = at.get_recipe("gpt")
PAD_ID, VOCAB_SIZE, IGNORE_INDEX = 256, 257, -100  # as in recipes/gpt.py


POSITIONS, BOOL_MASK, ADDITIVE_MASK, UNPACKABLE = "positions alone", "bool mask", "additive mask", "unpackable"


@dataclass(frozen=True)
class Packing:
    """How packed batches reach a model (`model_inputs`): each token's position in its own sequence, and
    - POSITIONS: nothing else; transformers' `create_causal_mask` finds where each sequence starts, where the
      model's code passes it the positions (OPT, BioGPT, XGLM and MPT do not: their sequences attend to each other);
    - BOOL_MASK: a 4-D causal mask within each sequence, True where a token may attend: SDPA's form, passed on as is;
    - ADDITIVE_MASK: the same mask as 0 where a token may attend and the lowest value of `dtype` elsewhere: eager
      and flex attention add a 4-D mask to their scores, so a bool one masks nothing there;
    - UNPACKABLE: no form keeps the model's sequences apart (Bloom: its ALiBi reads a 2-D mask); packed batches
      are refused, naming `model`."""

    form: str = POSITIONS
    dtype: torch.dtype = torch.float32
    model: str = ""


@dataclass
class ChunkedLossField:
    """The loss field of every recipe of a transformers causal LM (this one, hf_finetune, sft_chat, dpo)."""

    chunked_loss: bool = True
    """The output head's loss in chunks of the tokens that count (at.lm_loss), never the whole vocabulary's
    logits; false: from the logits (the same loss within 1e-6, more memory)."""


@dataclass
class HFCausalLMConfig(ChunkedLossField, ByteGPT.Config):  # type: ignore[name-defined,misc]
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 2
    block_size: int = 64
    n_positions: int = 256
    """The model's context (position embeddings), at least block_size: the longest window a fine-tune of this
    base reads (sft_chat's default is 128)."""
    own_loss: bool = False
    """Return the model's own `out.loss` from `labels` in the batch (the loop passes it num_items_in_batch, so it
    is exact too) instead of at.token_cross_entropy on its logits."""

    def __post_init__(self) -> None:
        if self.n_positions < self.block_size:
            raise at.ConfigError(
                f"n_positions={self.n_positions} is shorter than block_size={self.block_size}: the model reads"
                f" windows of block_size tokens; raise n_positions to {self.block_size} or more"
            )
        super().__post_init__()


@at.register_recipe("hf_causal_lm")
class HFCausalLM(ByteGPT):  # type: ignore[valid-type,misc]
    """transformers GPT2LMHeadModel (random init) on Python's stdlib bytes, with the exact token loss."""

    Config = HFCausalLMConfig
    tp_plan: dict[str, str] = {}  # not the GPT's: GPT-2's fused qkv (c_attn, a Conv1D) has no column split here
    sequence_dims: dict[str, int] = {}  # no context parallelism: transformers' 4-D masks do not shard with DTensor

    @property
    def wrap_classes(self) -> tuple[type[torch.nn.Module], ...]:  # type: ignore[override]
        """GPT-2's decoder block. transformers is imported when the recipe is used, not when it is listed:
        every process imports every recipe of the folder, and transformers takes a second to import."""
        return (_transformers().models.gpt2.modeling_gpt2.GPT2Block,)

    def build_model(self, cfg: HFCausalLMConfig) -> Any:
        transformers = _transformers()
        quiet_padding_advice()
        config = transformers.GPT2Config(
            vocab_size=VOCAB_SIZE, n_positions=cfg.n_positions, n_embd=cfg.d_model, n_layer=cfg.n_layer,
            n_head=cfg.n_head, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            bos_token_id=PAD_ID, eos_token_id=PAD_ID, pad_token_id=PAD_ID,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # a model built from a config has none: transformers says so at each forward
        return self.packed_by_positions(self.with_chunked_loss(model))

    packing: Packing = Packing()
    """How packed batches reach the model (`model_inputs`); set by `packed_by_positions`."""
    packing_measured = False

    def packed_by_positions(self, model: Any) -> Any:
        """`model`, with the form in which this recipe's packed batches reach it, measured on it (`measured_packing`).
        A copy whose weights are not here keeps the form measured on the real model (the FLOP count's meta copy,
        built after the first step), else takes the form assumed for its architecture (`assumed_packing`:
        `estimate`'s fake model, FSDP's other processes under RAM-efficient loading)."""
        measured = measured_packing(model)
        if measured is not None:
            self.packing, self.packing_measured = measured, True
        elif not self.packing_measured:
            self.packing = assumed_packing(model)
        return model

    def with_chunked_loss(self, model: Any) -> Any:
        """`model`, its forward taking the loss in chunks (at.with_chunked_loss), measured exact where its weights
        are here; one line where it is not (its logits are not its head's product of its last hidden state).

        Raises:
            RecipeError: the chunked loss differs from the loss of the model's own logits.
        """
        model = at.with_chunked_loss(model)
        if self.cfg.chunked_loss and at.measure_chunked_loss(model) is False:
            raise at.RecipeError(
                f"{type(model).__name__}'s logits are not its output head's product of its last hidden state"
                " (measured), so its loss cannot be computed in chunks: give chunked_loss=false"
            )
        return model

    def build_tokenizer(self, cfg: Any) -> Any:
        """The model's tokenizer: each byte is its own id (0-255, as the data encodes text), 256 is padding and
        end of text. Made with `tokenizers` (GPT-2's byte-level pre-tokenizer, no merges); final/ holds it."""
        return byte_tokenizer()

    def compute_loss(self, model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Padding is only at the end of a sequence, so causal attention never lets a real token see it.
        if self.cfg.own_loss:
            return model(**model_inputs(batch, self.packing), labels=batch["labels"]).loss
        return self.token_loss(model, batch)

    def token_loss(self, model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The summed loss of the batch's targets with their count: in chunks (at.lm_loss), or from the logits."""
        inputs = model_inputs(batch, self.packing)
        if self.cfg.chunked_loss:
            return at.lm_loss(model, inputs, batch["targets"], IGNORE_INDEX)  # type: ignore[no-any-return]
        return at.token_cross_entropy(model(**inputs).logits, batch["targets"], IGNORE_INDEX)

    def sequence_losses(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each sequence's summed loss of its targets (batch,): in chunks, or from the logits."""
        targets = batch["targets"]
        if self.cfg.chunked_loss:
            return at.lm_token_losses(model, model_inputs(batch, self.packing), targets, IGNORE_INDEX).sum(dim=1)
        logits = model(**model_inputs(batch, self.packing)).logits
        return token_losses_of_logits(logits, targets).sum(dim=1)  # -100 is IGNORE_INDEX there too

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The GPT's batch; with own_loss also transformers' `labels`: the inputs, IGNORE_INDEX at padding (the
        model shifts them itself, so the last byte of each sequence is not a target there)."""
        batch = super().collate(examples)
        if self.cfg.own_loss and "documents" in batch:
            raise at.RecipeError(
                "own_loss=true does not combine with pack_sequences=true: the model's own loss shifts its labels"
                " across the paragraphs of a window; use the default loss (own_loss=false)"
            )
        if self.cfg.own_loss:  # padding is where no target is (a real tokenizer may pad with its end-of-text id)
            batch["labels"] = batch["input_ids"].masked_fill(batch["targets"] == IGNORE_INDEX, IGNORE_INDEX)
        return batch

    def eval_metrics(self, model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        targets = batch["targets"]
        losses = self.sequence_losses(model, batch)
        tokens = (targets != IGNORE_INDEX).sum(1)
        bits = "bits_per_char" if self.byte_level else "bits_per_token"  # a byte is a character of ASCII text
        return {"loss": (losses, tokens), bits: (losses / math.log(2), tokens)}

    @property
    def byte_level(self) -> bool:
        """Whether the model reads bytes (this recipe's tokenizer), not a real tokenizer's tokens."""
        return self.tokenizer is None or len(self.tokenizer) == VOCAB_SIZE

    def write_artifacts(self, model: Any, eval_dataset: Any, run_dir: Path) -> None:
        """Save `samples.txt`: what the model writes after a few Python prompts (sampled, fixed seed; a byte-level
        model writes the whole block, its padding being its end of text, a real tokenizer's to its end of text)."""
        torch.manual_seed(self.cfg.seed)
        tokenizer = self.tokenizer if self.tokenizer is not None else byte_tokenizer()
        samples = []
        for prompt in ["def ", "class ", "import "]:
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.cfg.block_size - ids.shape[1],
                do_sample=True, temperature=0.8, pad_token_id=self.pad_id,
                **({"bad_words_ids": [[PAD_ID]]} if self.byte_level else {"eos_token_id": tokenizer.eos_token_id}),
            )  # fmt: skip
            samples.append(tokenizer.decode(out[0], skip_special_tokens=True))
        (run_dir / "samples.txt").write_text("\n\n----------\n\n".join(samples) + "\n")


class _RightPaddingAdvice(logging.Filter):
    """transformers' advice to pass an attention_mask when input_ids hold the pad token: these batches pad on the
    right only, where causal attention never lets a real token see padding, and the loss ignores it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "attention_mask" not in record.getMessage()


def quiet_padding_advice() -> None:
    logger = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(existing, _RightPaddingAdvice) for existing in logger.filters):
        logger.addFilter(_RightPaddingAdvice())


def model_inputs(batch: dict[str, torch.Tensor], packing: Packing = Packing()) -> dict[str, Any]:
    """What the model reads of a batch. A packed one (pack_sequences=true, sft_chat) also gives each token its
    position in its own paragraph or conversation, and keeps attention within it in the form `packing` names:
    - the positions alone, as transformers' flattening collator gives them: the model finds where each sequence
      starts (a position that does not follow the one before) and masks within each, with no mask of ours: the
      form SDPA and flash-attention's varlen kernels take. `use_cache=False`: with a cache, transformers skips that
      search and a sequence attends to the ones before it (canary: tests/test_hf.py);
    - otherwise a causal mask within each paragraph (4-D), built here (`document_mask`)."""
    if "documents" not in batch:
        return {"input_ids": batch["input_ids"]}
    if packing.form == UNPACKABLE:
        raise at.RecipeError(
            f"{packing.model} keeps packed sequences apart neither by their positions nor with a 4-D attention mask"
            " (measured when it was built): train it on unpacked batches (pack_sequences=false; sft_chat always packs)"
        )
    searched = packing.form == POSITIONS and not batch["positions"].is_meta  # the search reads values: not on meta
    if searched:  # (the FLOP count's meta copy)
        return {"input_ids": batch["input_ids"], "position_ids": batch["positions"], "use_cache": False}
    return {
        "input_ids": batch["input_ids"],
        "position_ids": batch["positions"],
        "attention_mask": document_mask(batch["documents"], packing),
    }


def document_mask(documents: torch.Tensor, packing: Packing) -> torch.Tensor:
    """The (batch, 1, L, L) causal mask within each document: True where a token may attend, or, for
    ADDITIVE_MASK, 0 there and the lowest value of the model's dtype elsewhere (transformers' own eager mask)."""
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    allowed = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
    if packing.form != ADDITIVE_MASK:
        return allowed
    blocked = torch.zeros(allowed.shape, dtype=packing.dtype, device=documents.device)
    return blocked.masked_fill(~allowed, torch.finfo(packing.dtype).min)


PROBE_IDS, PROBE_FIRST = (5, 9, 3, 7, 11, 4, 8, 6, 2), 4
"""`measured_packing`'s row: a sequence of 4 tokens, then one of 5."""


def measured_packing(model: torch.nn.Module) -> Packing | None:
    """The first form (POSITIONS, BOOL_MASK, ADDITIVE_MASK) in which `model` reads a row of two packed sequences
    as it reads the second alone (`_reads_apart`), measured on the model with its own weights: a few forwards and
    backwards of 9 tokens in eval mode, its modes and the random state left as they were. UNPACKABLE when forms
    run and none is exact. None when nothing can be measured here: weights on the meta device or fake (the FLOP
    count's copy, `estimate`, FSDP's other processes under RAM-efficient loading), a model without transformers'
    `get_input_embeddings`, or one that runs in no form here (flash-attention on the CPU)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import is_fake

    parameters = list(model.parameters())
    if not parameters or not hasattr(model, "get_input_embeddings") or detect_fake_mode() is not None:
        return None
    if any(parameter.is_meta or is_fake(parameter) for parameter in parameters):
        return None
    parameter = parameters[0]
    dtype, ran = at.computation_dtype(model), False
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
            batch = _probe_batch(model, parameter.device)
            with torch.no_grad():
                alone = model(input_ids=batch["input_ids"][:, PROBE_FIRST:], use_cache=False).logits
            for form in (POSITIONS, BOOL_MASK, ADDITIVE_MASK):
                try:
                    apart = _reads_apart(model, batch, Packing(form, dtype), alone)
                except Exception:  # noqa: BLE001 - a form the model's code does not take (Bloom: a 4-D mask)
                    continue
                ran = True
                if apart:
                    return Packing(form, dtype)
    except Exception:  # noqa: BLE001 - the model does not run here at all
        return None
    finally:
        for module, training in modes.items():
            module.training = training
    return Packing(UNPACKABLE, dtype, type(model).__name__) if ran else None


def _probe_batch(model: Any, device: torch.device) -> dict[str, torch.Tensor]:
    vocabulary = model.get_input_embeddings().weight.shape[0]
    lengths = (PROBE_FIRST, len(PROBE_IDS) - PROBE_FIRST)
    return {
        "input_ids": torch.tensor([PROBE_IDS], device=device) % vocabulary,
        "positions": torch.cat([torch.arange(n, device=device) for n in lengths])[None],
        "documents": torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])[None],
    }


def _reads_apart(model: Any, batch: dict[str, torch.Tensor], packing: Packing, alone: torch.Tensor) -> bool:
    """Whether the packed row's second sequence, given in the form `packing`, reads nothing of the first: the
    gradient of its logits with respect to the first's input embeddings is exactly zero (attention of probability
    0 passes none back, in any dtype, where a leak, however small, gives some), and its logits are those of the
    sequence alone, to rounding (a model that numbered its positions itself would differ)."""
    inputs = model_inputs(batch, packing)
    embeddings = model.get_input_embeddings()(inputs.pop("input_ids")).detach().requires_grad_()
    second = model(inputs_embeds=embeddings, **{**inputs, "use_cache": False}).logits[:, PROBE_FIRST:].float()
    (gradient,) = torch.autograd.grad(second.square().sum(), embeddings)
    tolerance = 1e-4 if alone.dtype in (torch.float32, torch.float64) else 3e-2  # of the largest logit
    error = (second.detach() - alone.float()).abs().max()
    return not bool(gradient[:, :PROBE_FIRST].any()) and bool(error <= tolerance * alone.float().abs().max())


POSITIONS_VERIFIED = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox"})
UNPACKABLE_VERIFIED = frozenset({"bloom"})
"""The `model_type`s whose tiny random models `measured_packing` finds to take the positions alone (with SDPA and
eager attention), and to take no form: what `assumed_packing` assumes of a model it cannot measure
(tests/test_packed_positions.py measures each)."""


def assumed_packing(model: torch.nn.Module) -> Packing:
    """The form for a model whose weights are not here (`measured_packing` is None): the positions alone for an
    architecture measured to take them (POSITIONS_VERIFIED), none for one measured to take none, else the 4-D
    mask in its attention's form: bool for SDPA and a model of other code than transformers, additive otherwise."""
    config = getattr(model, "config", None)
    model_type, dtype = getattr(config, "model_type", None), getattr(model, "dtype", torch.float32)
    if model_type in POSITIONS_VERIFIED:
        return Packing(POSITIONS, dtype)
    if model_type in UNPACKABLE_VERIFIED:
        return Packing(UNPACKABLE, dtype, type(model).__name__)
    additive = config is not None and getattr(config, "_attn_implementation", None) not in ("sdpa", None)
    return Packing(ADDITIVE_MASK if additive else BOOL_MASK, dtype)


def packs_by_positions(model: torch.nn.Module) -> bool:
    """Whether packed sequences reach `model` by their positions alone: measured on it, else assumed."""
    measured = measured_packing(model)
    return (assumed_packing(model) if measured is None else measured).form == POSITIONS


def byte_tokenizer() -> Any:
    """A transformers tokenizer whose ids are the UTF-8 bytes of the text, and PAD_ID for <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {character: byte for byte, character in bytes_to_unicode().items()} | {"<pad>": PAD_ID}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<pad>", chat_template=QUESTION_ANSWER_TEMPLATE
    )


QUESTION_ANSWER_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '### Question\\n' + message['content'] + '\\n### Answer\\n' }}"
    "{% else %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}"
)
"""The byte-level model's own chat template, which sft_chat's demo teaches it: a question, then its answer to the
end-of-text token."""


def _transformers() -> Any:
    """The transformers package, or a one-line error saying how to install it (the recipe is listed without it)."""
    try:
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401 - GPT2Block's module, for wrap_classes
    except ImportError as error:
        raise at.RecipeError("recipe hf_causal_lm needs transformers: pip install -e '.[hf]'") from error
    return transformers


if __name__ == "__main__":
    at.main("hf_causal_lm")
