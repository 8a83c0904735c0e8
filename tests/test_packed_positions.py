"""Packed sequences kept apart in transformers models of several architectures (recipes/hf_causal_lm.py).

hf_causal_lm packs several documents into one row and keeps each apart in the first form that a probe of the
model finds exact when the model is built (`measured_packing`): the positions alone (transformers'
`create_causal_mask` finds the sequences, where the model's code passes it the positions), else a 4-D mask in the
form its attention takes (bool for SDPA, additive for eager attention, which adds the mask to its scores), else
none (packed batches refused). Each tiny random model (built from its config, nothing downloaded) reads a packed
batch as it reads each document alone, its training loss the sum of the documents' losses. The old static check
(does the modeling module import `create_causal_mask`?) gave OPT, BioGPT and Bloom the positions alone, and their
documents attended to each other.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import accel_trainer as at  # noqa: E402

RECIPE = at.get_recipe("hf_causal_lm")
hf_causal_lm = sys.modules[RECIPE.__module__]
SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)  # fmt: skip
POSITIONS, BOOL_MASK, ADDITIVE_MASK, UNPACKABLE = "positions alone", "bool mask", "additive mask", "unpackable"
TAKE_POSITIONS = ["gemma", "gpt2", "gpt_neox", "llama", "mistral", "phi3", "qwen2", "qwen3"]
ARCHITECTURES = [  # (model_type, attention, the form measured): Bloom and Gemma 2 have no SDPA in transformers 5
    *[(model_type, attention, POSITIONS) for model_type in TAKE_POSITIONS for attention in ("sdpa", "eager")],
    ("gemma2", "eager", POSITIONS),
    ("opt", "sdpa", BOOL_MASK), ("opt", "eager", ADDITIVE_MASK),
    ("biogpt", "sdpa", BOOL_MASK), ("biogpt", "eager", ADDITIVE_MASK),
    ("bloom", "eager", UNPACKABLE),
]  # fmt: skip
FIRST, SECOND = [5, 9, 3, 7, 11], [4, 8, 6, 2, 10, 12, 13]  # a window of 12 tokens: 11 inputs, 11 targets


def tiny(model_type: str, attention: str) -> torch.nn.Module:
    """A 2-layer model of the architecture, width 16, random weights (seeded)."""
    config = transformers.AutoConfig.for_model(model_type)
    for name, value in SMALL.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def packed_recipe_and_batch(model: torch.nn.Module) -> tuple[object, dict[str, torch.Tensor]]:
    recipe = RECIPE(RECIPE.Config(n_layer=1, n_head=2, d_model=16, block_size=16, pack_sequences=True))
    recipe.packed_by_positions(recipe.with_chunked_loss(model))  # what build_model does with the model it built
    return recipe, recipe.collate([{"input_ids": FIRST + SECOND, "documents": [0] * 5 + [1] * 7}])


@pytest.mark.parametrize(("model_type", "attention", "form"), ARCHITECTURES, ids=lambda value: str(value))
def test_a_packed_batch_reads_each_document_as_if_it_were_alone(model_type, attention, form):
    model = tiny(model_type, attention)
    recipe, batch = packed_recipe_and_batch(model)
    assert model.training  # the probe leaves the model's mode as it found it
    model.eval()
    if form == UNPACKABLE:
        with pytest.raises(at.RecipeError, match=r"BloomForCausalLM keeps packed sequences apart neither by"):
            recipe.compute_loss(model, batch)
        return
    with torch.no_grad():
        packed = model(**hf_causal_lm.model_inputs(batch, recipe.packing)).logits
        alone = [model(input_ids=torch.tensor([ids])).logits for ids in (FIRST, SECOND[:-1])]
        loss = recipe.compute_loss(model, batch)
    torch.testing.assert_close(packed[:, :5], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 5:], alone[1], rtol=1e-5, atol=1e-5)
    cross_entropy = torch.nn.functional.cross_entropy  # each document's next tokens (FIRST's last has none)
    losses = [cross_entropy(alone[0][0, :-1], torch.tensor(FIRST[1:]), reduction="sum"),
              cross_entropy(alone[1][0], torch.tensor(SECOND[1:]), reduction="sum")]  # fmt: skip
    assert int(loss["num_items"]) == len(FIRST) - 1 + len(SECOND) - 1
    torch.testing.assert_close(loss["loss"], losses[0] + losses[1], rtol=1e-5, atol=1e-5)
    assert recipe.packing.form == form


def test_the_architectures_assumed_to_take_the_positions_alone_or_no_form_are_those_measured_here():
    assert {"gemma2", *TAKE_POSITIONS} == hf_causal_lm.POSITIONS_VERIFIED
    assert {"bloom"} == hf_causal_lm.UNPACKABLE_VERIFIED


def test_an_architecture_that_cannot_be_measured_is_assumed_to_take_the_form_measured_on_it():
    """A copy of the model without its weights (meta device, fake tensors) cannot be probed: it is assumed to
    take the positions alone where its architecture was measured to (the cases above), else the mask in its
    attention's form; the recipe keeps the form measured on the real model (the FLOP count's meta copy)."""
    for model_type, attention, form in ARCHITECTURES:
        assert hf_causal_lm.measured_packing(tiny(model_type, attention)).form == form, (model_type, attention)
        with torch.device("meta"):
            copy = tiny(model_type, attention)
        assert hf_causal_lm.measured_packing(copy) is None
        assert hf_causal_lm.assumed_packing(copy).form == form, (model_type, attention)
    recipe, _ = packed_recipe_and_batch(tiny("opt", "eager"))
    with torch.device("meta"):
        recipe.packed_by_positions(tiny("opt", "sdpa"))
    assert recipe.packing.form == ADDITIVE_MASK  # kept: measured on the real one
    fresh = RECIPE(RECIPE.Config())
    with torch.device("meta"):
        fresh.packed_by_positions(tiny("llama", "sdpa"))
    assert fresh.packing.form == POSITIONS  # the assumed form when nothing was measured


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_4d_mask_form_keeps_a_gpt2s_packed_documents_apart_in_its_attention(attention):
    """The mask forms themselves, on a GPT-2 (which would take the positions alone): the additive mask is exact
    with either attention, the bool one with SDPA only. Canary: transformers passes a user's 4-D mask to the
    attention as it is (masking_utils `_preprocess_mask_arguments`), and eager attention adds it to its scores,
    where True adds 1 and masks nothing; fails the day transformers converts a bool mask for eager attention."""
    model = tiny("gpt2", attention).eval()
    _, batch = packed_recipe_and_batch(model)
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([SECOND[:-1]])).logits
        for form in (BOOL_MASK, ADDITIVE_MASK):
            inputs = hf_causal_lm.model_inputs(batch, hf_causal_lm.Packing(form, torch.float32))
            assert inputs["attention_mask"].dtype == (torch.bool if form == BOOL_MASK else torch.float32)
            packed = model(**inputs).logits[:, 5:]
            exact = torch.allclose(packed, alone, rtol=1e-5, atol=1e-5)
            assert exact is (form == ADDITIVE_MASK or attention == "sdpa"), form


def test_the_probe_leaves_the_random_state_and_the_modules_modes_alone():
    model = tiny("llama", "sdpa")
    model.model.layers[0].eval()  # a submodule in another mode than the model's
    state = torch.random.get_rng_state()
    assert hf_causal_lm.measured_packing(model).form == POSITIONS
    assert torch.equal(torch.random.get_rng_state(), state)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert not any(parameter.grad is not None for parameter in model.parameters())
