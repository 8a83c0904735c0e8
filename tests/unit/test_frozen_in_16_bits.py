"""QLoRA's frozen embedding and head held in bfloat16 (accel_trainer/contract/frozen_in_16_bits.py): one 16-bit
tensor for a tied pair, a float32 computation of its values, the chunked loss equal to the whole logits' within
1e-6 with no float32 copy of the whole head, and the dtype given back for final/."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel_trainer as at
from accel_trainer.contract import frozen_in_16_bits, lm_loss, quantization

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("torchao")

VOCABULARY = 640


def tiny_qlora(tied: bool = True) -> tuple[nn.Module, nn.Module]:
    """A QLoRA model (quantized, adapter on every linear layer) and its float32 twin with the same 4 bits and the
    embedding and head rounded to bf16 values, kept in float32: the computation the 16-bit one must do."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCABULARY, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=tied)  # fmt: skip
    base = transformers.LlamaForCausalLM(config)
    twin = copy.deepcopy(base)
    at.quantize_base(base, "nf4")
    at.quantize_base(twin, "nf4")
    frozen_in_16_bits.restore_dtype(twin)  # float32 weights of the bf16-rounded values
    adapted = []
    for model in (base, twin):
        torch.manual_seed(1)
        lora = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights="gaussian")
        adapted.append(peft.get_peft_model(model, lora))
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, parameter in adapted[-1].named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1, generator=generator)  # an adapter that changes the logits
    return adapted[0], adapted[1]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCABULARY, (3, 40), generator=generator)
    targets = torch.randint(0, VOCABULARY, (3, 40), generator=generator)
    targets[:, :10] = -100
    return ids, targets


def test_a_tied_embedding_and_head_are_one_frozen_bf16_tensor_and_the_model_computes_in_float32():
    model, twin = tiny_qlora()
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embedding.weight is head.weight and embedding.weight.dtype == torch.bfloat16
    assert not embedding.weight.requires_grad and type(head) is frozen_in_16_bits.SixteenBitHead
    assert at.computation_dtype(model) == torch.float32
    ids, _ = batch()
    with torch.no_grad():
        logits, expected = model(input_ids=ids).logits, twin(input_ids=ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_the_chunked_loss_of_a_16_bit_head_equals_the_whole_logits_loss_and_its_gradients(tied, monkeypatch):
    monkeypatch.setattr(frozen_in_16_bits, "VOCABULARY_SLICE", 96)  # several slices of the vocabulary
    monkeypatch.setattr(frozen_in_16_bits, "ROW_CHUNK", 16)  # several chunks of rows
    model, twin = tiny_qlora(tied)
    ids, targets = batch()
    chunked = at.lm_loss(at.with_chunked_loss(model), {"input_ids": ids}, targets)
    logits = twin(input_ids=ids).logits
    whole = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    chunked["loss"].backward()
    whole.backward()
    assert abs(float(chunked["loss"]) - float(whole)) <= 1e-6 * abs(float(whole))
    ours = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "lora" in n])
    theirs = torch.cat([p.grad.flatten() for n, p in twin.named_parameters() if "lora" in n])
    assert float((ours - theirs).norm() / theirs.norm()) <= 1e-6
    per_token = at.lm_token_losses(model, {"input_ids": ids}, targets)
    expected = F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    torch.testing.assert_close(per_token.detach(), expected * (targets != -100), rtol=1e-5, atol=1e-6)


def test_the_loss_never_holds_the_whole_head_in_float32(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(frozen_in_16_bits, "VOCABULARY_SLICE", 64)
    monkeypatch.setattr(frozen_in_16_bits, "ROW_CHUNK", 8)
    model, _ = tiny_qlora()
    head = model.get_output_embeddings()
    hidden = torch.randn(3, 40, 64, requires_grad=True)
    _, targets = batch()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        lm_loss.head_cross_entropy(hidden, head, lm_loss.HeadLoss(targets))["loss"].backward()
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert hidden.grad is not None and 0 < largest < VOCABULARY * 64 * 4 / 2  # the whole head in float32


def test_the_dtype_comes_back_for_final_and_the_loss_of_a_plain_head_is_unchanged():
    model, twin = tiny_qlora()
    quantization.dequantize(model)
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert type(model.get_output_embeddings()) is nn.Linear and model.dtype == torch.float32
    assert lm_loss._head_of(twin.get_base_model()) is twin.get_output_embeddings()
