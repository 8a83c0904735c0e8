"""A causal LM's loss in chunks of the tokens that count (accel_trainer/contract/lm_loss.py): equal to the loss of
the whole logits within 1e-6 (relative), loss and gradients, with LoRA and in full, per token and summed; never
a tensor of the whole vocabulary's scores for every token; and where the chunks would compute another loss (a
model whose logits are not its head's product), the model's own logits or a one-line refusal. The same on DDP
and FSDP2: tests/test_real_models.py's chat fine-tunes compare their first step with the full logits' run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import accel_trainer as at
from accel_trainer.contract import lm_loss

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCABULARY, TOKENS = 3000, (4, 40)


def tiny_llama(**config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    settings = dict(vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **config}))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCABULARY, TOKENS, generator=generator)
    targets = torch.randint(0, VOCABULARY, TOKENS, generator=generator)
    targets[:, :15] = -100  # a prompt
    targets[1, 30:] = -100  # padding
    return ids, targets


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def full_logits_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def gradients(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.fixture
def several_chunks(monkeypatch):
    """Chunks of 16 rows: the batch's 90 counted tokens in 6 chunks (the default's 128 rows would take one)."""
    monkeypatch.setattr(lm_loss, "MIN_CHUNK_ROWS", 16)
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 16 * 4 * VOCABULARY)


@pytest.mark.parametrize("adapter", [True, False], ids=["lora", "full"])
def test_the_chunked_loss_and_its_gradients_equal_the_whole_logits_within_1e_6(adapter, several_chunks):
    model = tiny_llama()
    if adapter:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    reference = copy.deepcopy(model)
    at.with_chunked_loss(model)
    ids, targets = batch()

    chunked = at.lm_loss(model, {"input_ids": ids}, targets)
    chunked["loss"].backward()
    expected = full_logits_loss(reference, ids, targets)
    expected.backward()

    assert int(chunked["num_items"]) == int((targets != -100).sum()) == 90
    assert relative_error(chunked["loss"].detach(), expected.detach()) <= 1e-6
    assert relative_error(gradients(model), gradients(reference)) <= 1e-6


def test_each_tokens_loss_is_in_its_place_zero_where_ignored_with_the_gradients_of_per_sequence_sums(several_chunks):
    model, ids, targets = tiny_llama(), *batch()
    reference = copy.deepcopy(model)
    at.with_chunked_loss(model)
    weights = torch.tensor([0.5, -2.0, 1.0, 3.0])  # a per-sequence weighting, as DPO's

    losses = at.lm_token_losses(model, {"input_ids": ids}, targets)
    (losses.sum(dim=1) * weights).sum().backward()
    logits = reference(input_ids=ids).logits.float()
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    (expected.sum(dim=1) * weights).sum().backward()

    assert losses.shape == targets.shape and bool((losses[targets == -100] == 0).all())
    assert relative_error(losses.detach(), expected.detach()) <= 1e-6
    assert relative_error(gradients(model), gradients(reference)) <= 1e-6


@pytest.mark.parametrize("config", [{}, {"logit_scale": 0.5}], ids=["chunks", "kept-logits"])
def test_entropies_come_with_the_losses_from_one_forward_each_the_distributions_own(config, several_chunks):
    model, ids, targets = tiny_llama(**config), *batch()
    logits = copy.deepcopy(model)(input_ids=ids).logits.float()
    at.with_chunked_loss(model)

    losses, entropies = at.lm_token_losses_and_entropies(model, {"input_ids": ids}, targets)
    expected = torch.distributions.Categorical(logits=logits).entropy() * (targets != -100)

    assert torch.equal(losses, at.lm_token_losses(model, {"input_ids": ids}, targets))
    assert entropies.shape == targets.shape and not entropies.requires_grad
    assert relative_error(entropies, expected) <= 1e-6


def test_a_batch_with_no_counted_token_is_a_zero_loss_that_backpropagates():
    model = at.with_chunked_loss(tiny_llama())
    ids, _ = batch()
    out = at.lm_loss(model, {"input_ids": ids}, torch.full(TOKENS, -100))
    out["loss"].backward()
    assert float(out["loss"]) == 0.0 and int(out["num_items"]) == 0
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters() if p.grad is not None)


def test_under_bf16_autocast_the_head_runs_in_bf16_as_the_whole_logits_do():
    model, ids, targets = tiny_llama(), *batch()
    reference = copy.deepcopy(model)
    at.with_chunked_loss(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = at.lm_loss(model, {"input_ids": ids}, targets)["loss"]
        expected = full_logits_loss(reference, ids, targets)
    assert chunked.dtype == torch.float32
    assert relative_error(chunked.detach(), expected.detach()) <= 1e-2  # bf16 logits vs float32 accumulation


@pytest.mark.parametrize("per_token", [False, True])
def test_under_bf16_autocast_the_head_multiplies_bf16_values_and_the_losses_keep_float32(per_token):
    """The products of the bf16-rounded rows and weight, their cross-entropy in float32: equal to a float64
    computation of the same rounded values within 1e-6, summed or per token (torch's 16-bit chunks alone return
    16-bit losses, 0.35% off a sum: the canary below)."""
    generator = torch.Generator().manual_seed(3)
    hidden, head = torch.randn(2, 150, 32, generator=generator), torch.nn.Linear(32, VOCABULARY, bias=False)
    targets = torch.randint(0, VOCABULARY, (2, 150), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lm_loss.head_cross_entropy(hidden, head, lm_loss.HeadLoss(targets, per_token=per_token))
    logits = hidden.bfloat16().double() @ head.weight.bfloat16().double().t()
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none" if per_token else "sum")
    actual = out if per_token else out["loss"]
    assert actual.dtype == torch.float32
    assert relative_error(actual.double().flatten(), expected) <= 1e-6


def test_canary_torch_chunked_cross_entropy_of_bf16_inputs_returns_bf16_losses():
    """lm_loss._in_autocast_dtype hands torch float32 values off CUDA because of this; the day it fails, torch
    returns float32 losses of 16-bit inputs and the rounding to float32 can go."""
    x, w, y = torch.randn(300, 16).bfloat16(), torch.randn(500, 16).bfloat16(), torch.randint(0, 500, (300,))
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=128, chunking_method=None, acc_dtype=torch.float32)
    assert F.linear_cross_entropy(x, w, y, reduction="sum", options=options).dtype == torch.bfloat16


def test_no_tensor_of_the_whole_vocabulary_for_every_token_is_ever_allocated(several_chunks):
    from torch.profiler import ProfilerActivity, profile

    model, ids, targets = at.with_chunked_loss(tiny_llama()), *batch()
    whole_logits = ids.numel() * VOCABULARY * 4
    largest = {}
    for chunked in (True, False):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            if chunked:
                at.lm_loss(model, {"input_ids": ids}, targets)["loss"].backward()
            else:
                full_logits_loss(model, ids, targets).backward()
        largest[chunked] = max(event.cpu_memory_usage for event in prof.events())
    assert largest[False] >= whole_logits  # the negative control: the whole logits are allocated
    assert largest[True] < whole_logits / 4


def test_the_flop_count_on_meta_counts_the_head_over_every_position():
    from torch.utils.flop_counter import FlopCounterMode

    from accel_trainer.observe.flops import _MetaScalarsAreOne  # as the run counts: values read off meta are 1

    with torch.device("meta"):
        model = at.with_chunked_loss(tiny_llama())
    ids, targets = (tensor.to("meta") for tensor in batch())
    counts = {}
    for chunked in (True, False):
        with FlopCounterMode(display=False) as counter, _MetaScalarsAreOne():
            loss = at.lm_loss(model, {"input_ids": ids}, targets)["loss"] if chunked else None
            if loss is None:
                loss = full_logits_loss(model, ids, targets)
            loss.backward()
        counts[chunked] = counter.get_total_flops()
    assert counts[True] == counts[False] > 0


def test_a_model_whose_config_scales_its_logits_keeps_its_own_logits_of_the_counted_tokens():
    model = tiny_llama(logit_scale=0.5)  # Cohere's field: Llama ignores it, and the loss must be the model's own
    reference = copy.deepcopy(model)
    at.with_chunked_loss(model)
    ids, targets = batch()
    assert (
        relative_error(
            at.lm_loss(model, {"input_ids": ids}, targets)["loss"], full_logits_loss(reference, ids, targets)
        )
        <= 1e-6
    )
    assert at.measure_chunked_loss(model) is True


class DoubledLogits(transformers.LlamaForCausalLM):
    """A model whose forward changes its logits after the head, as no config field says."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_a_model_whose_logits_are_not_its_heads_product_is_measured_inexact_and_a_recipe_refuses_it(tiny_base):
    model = DoubledLogits(tiny_llama().config)
    assert at.measure_chunked_loss(at.with_chunked_loss(model)) is False
    assert at.measure_chunked_loss(at.with_chunked_loss(tiny_llama())) is True

    recipe_cls = at.get_recipe("hf_finetune")
    recipe = recipe_cls(recipe_cls.Config(base=str(tiny_base)))
    with pytest.raises(at.RecipeError, match="chunked_loss=false"):
        recipe.with_chunked_loss(model)
    recipe.cfg.chunked_loss = False
    assert recipe.with_chunked_loss(model) is model  # the logits' loss: nothing to refuse


def test_the_forward_is_the_models_own_without_head_loss_and_a_copy_runs_its_own_weights():
    model = at.with_chunked_loss(tiny_llama())
    ids, targets = batch()
    plain = tiny_llama()
    assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert torch.equal(model.generate(ids[:1, :5], max_new_tokens=3), plain.generate(ids[:1, :5], max_new_tokens=3))

    pair = at.PolicyAndReference(model)  # the reference is a deep copy: its forward is bound to itself
    with torch.no_grad():
        pair.policy.lm_head.weight.mul_(2)
    policy, reference = pair(input_ids=ids, head_loss=at.HeadLoss(targets, per_token=True))
    assert not torch.allclose(policy, reference)
    assert torch.equal(reference, at.lm_token_losses(at.with_chunked_loss(tiny_llama()), {"input_ids": ids}, targets))


def test_a_model_built_without_with_chunked_loss_is_given_its_forward_on_first_use():
    """A recipe that subclasses hf_causal_lm and builds its own model (tests/workers/recipes/tiny_llama.py)."""
    ids, targets = batch()
    model, made = tiny_llama(), at.with_chunked_loss(tiny_llama())
    assert torch.equal(at.lm_loss(model, {"input_ids": ids}, targets)["loss"],
                       at.lm_loss(made, {"input_ids": ids}, targets)["loss"])  # fmt: skip
    assert model(input_ids=ids, head_loss=at.HeadLoss(targets))["num_items"] == 90  # its forward, from now on
    assert torch.equal(at.lm_loss(model, ids, targets)["loss"], at.lm_loss(model, {"input_ids": ids}, targets)["loss"])


def test_a_loss_asked_of_a_model_without_a_causal_lm_is_one_line():
    with pytest.raises(at.RecipeError, match="holds no transformers causal LM"):
        at.lm_loss(torch.nn.Linear(2, 2), {}, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(at.RecipeError, match="holds no transformers causal LM"):
        at.with_chunked_loss(torch.nn.Linear(2, 2))
