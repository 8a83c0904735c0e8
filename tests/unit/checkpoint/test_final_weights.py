"""`final/model.safetensors`: every name of a plain model's weights, tied ones under each name; a transformers model's
tied weights once, as `save_pretrained` keeps them, which `from_pretrained` ties again.

A user loads a plain PyTorch model's file (the GPT, its LM head tied to the token embedding) into a freshly built
model with `model.load_state_dict(load_file(...))`, strictly. A transformers model whose config ties weights
(GPT-2's `lm_head.weight` is `transformer.wte.weight`) is written without the tied copy: `from_pretrained` loads it
to the same model, and `with_tied_names` gives `load_state_dict` the name left out. An export of the run's checkpoint
is a plain state dict with every name. The final save builds its copy of the model without weights and hands it the
trained ones: no base is read again. A LoRA (or QLoRA) model's final/ holds peft's merge, bit for bit, written one
merged weight at a time (checkpoint/merged_weights.py), the whole merge never held beside the trained model.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

import accel_trainer as at
from accel_trainer.checkpoint.export import export
from accel_trainer.checkpoint.final_weights import merged, model_holding, with_tied_names, write_model_folder
from accel_trainer.config.train_config import resolve_config
from accel_trainer.contract.quantization import is_quantized

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 32, "max_source_bytes": 50_000, "max_steps": 1,
        "global_batch_size": 4, "micro_batch_size": 4, "eval_every_steps": 0, "show_progress_bar": False}  # fmt: skip
TIED = {
    "gpt": ("lm_head.weight", "token_embedding.weight"),
    "hf_causal_lm": ("lm_head.weight", "transformer.wte.weight"),
}
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the hf extra")


def built(recipe: str):
    cfg = resolve_config(at.get_recipe(recipe).Config, None, TINY)
    return at.get_recipe(recipe)(cfg).build_model(cfg)


def test_a_plain_models_final_weights_load_strictly_into_a_freshly_built_model_tied_weights_under_each_name(tmp_path):
    run_dir = at.train("gpt", output_dir=str(tmp_path / "run"), **TINY).run_dir
    model, final = built("gpt"), load_file(str(run_dir / "final" / "model.safetensors"))

    model.load_state_dict(final)  # strict: no name missing, none left over

    head, embedding = TIED["gpt"]
    assert model.get_parameter(head) is model.get_parameter(embedding)  # still one tensor
    assert torch.equal(final[head], final[embedding])
    exported = load_file(str(export(run_dir, tmp_path / "export") / "model.safetensors"))
    assert exported.keys() == final.keys()


@needs_transformers
def test_a_transformers_models_tied_weights_are_written_once_and_from_pretrained_loads_the_same_model(tmp_path):
    run_dir = at.train("hf_causal_lm", output_dir=str(tmp_path / "run"), **TINY).run_dir
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    head, embedding = TIED["hf_causal_lm"]
    assert embedding in final and head not in final  # the config ties them: one copy on disk

    model = built("hf_causal_lm")
    model.load_state_dict(with_tied_names(model, final))  # strict, the tied name given back
    loaded = type(model).from_pretrained(run_dir / "final")
    assert loaded.get_parameter(head) is loaded.get_parameter(embedding)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    exported = load_file(str(export(run_dir, tmp_path / "export") / "model.safetensors"))  # a plain state dict
    assert exported.keys() == final.keys() | {head} and torch.equal(exported[head], exported[embedding])


@pytest.mark.parametrize("recipe", ["gpt", pytest.param("hf_causal_lm", marks=needs_transformers)])
def test_the_final_saves_model_is_built_without_weights_and_holds_the_trained_tensors_tied_as_built(recipe):
    trained = built(recipe)
    cfg = resolve_config(at.get_recipe(recipe).Config, None, TINY)
    state = trained.state_dict()
    builds = []
    recipe_object = at.get_recipe(recipe)(cfg)
    original = recipe_object.build_model

    def recording(cfg):
        model = original(cfg)
        builds.append(all(parameter.is_meta for parameter in model.parameters()))
        return model

    recipe_object.build_model = recording
    model = model_holding(recipe_object, cfg, dict(state))

    assert builds == [True]  # parameters on meta: no weight made, no base read
    head, embedding = TIED[recipe]
    assert model.get_parameter(head) is model.get_parameter(embedding)
    for name, tensor in model.state_dict().items():
        assert tensor.data_ptr() == state[name].data_ptr(), name  # the trained tensor itself: no copy
    assert all(not buffer.is_meta for buffer in model.buffers())


def tiny_llama(transformers):
    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=True)
    )


def tiny_gpt2(transformers):
    shape = dict(n_layer=1, n_head=2, n_embd=64, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape))


@needs_transformers
@pytest.mark.parametrize(
    ("build", "bits"),
    [(tiny_llama, None), (tiny_llama, "nf4"), (tiny_gpt2, "nf4")],
    ids=["lora", "qlora", "qlora-conv1d"],
)
def test_a_lora_export_writes_peft_s_merge_one_weight_at_a_time_and_leaves_the_models_own_weights_as_they_were(
    tmp_path, build, bits
):
    import peft
    import transformers

    if bits:
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    base = build(transformers)
    conv1d = build is tiny_gpt2
    at.quantize_base(base, bits or "none")
    lora = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights="gaussian", fan_in_fan_out=conv1d)
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)  # an adapter that changes the weights it merges into
    weights = dict(model.named_parameters())  # the trained model's own tensors, which the export must not change
    before = {name: tensor.detach().clone() for name, tensor in weights.items() if not is_quantized(tensor)}
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits

    exported = write_model_folder(model, tmp_path / "final")

    assert exported is model  # the model that trained, its adapter unmerged: what the recipe's artifacts use
    assert all(torch.equal(weights[name], tensor) for name, tensor in before.items())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    written = load_file(str(tmp_path / "final" / "model.safetensors"))
    whole = merged(model).state_dict()  # peft's merge_and_unload of the whole model at once, into copies
    head = "lm_head.weight"
    assert written.keys() == whole.keys() - {head} and head in whole  # the head tied to the embedding: once
    assert all(torch.equal(written[name], whole[name]) for name in written), "not peft's merge, bit for bit"
