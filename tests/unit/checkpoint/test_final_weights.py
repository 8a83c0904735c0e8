"""`final/model.safetensors` is a plain state dict: every name of the model's, tied weights under each name.

A user loads it into a freshly built model with `model.load_state_dict(load_file(...))`, strictly, whether the
model is plain PyTorch (the GPT, its LM head tied to the token embedding) or a transformers model written with
`save_pretrained` (GPT-2's `lm_head.weight` is `transformer.wte.weight`), which `from_pretrained` still loads,
tied. An export of the run's checkpoint holds the same names.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

import accel_trainer as at
from accel_trainer.checkpoint.export import export
from accel_trainer.config.train_config import resolve_config

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 32, "max_source_bytes": 50_000, "max_steps": 1,
        "global_batch_size": 4, "micro_batch_size": 4, "eval_every_steps": 0, "show_progress_bar": False}  # fmt: skip
TIED = {
    "gpt": ("lm_head.weight", "token_embedding.weight"),
    "hf_causal_lm": ("lm_head.weight", "transformer.wte.weight"),
}
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the hf extra")


@pytest.mark.parametrize("recipe", ["gpt", pytest.param("hf_causal_lm", marks=needs_transformers)])
def test_final_weights_load_strictly_into_a_freshly_built_model_tied_weights_included(recipe, tmp_path):
    run_dir = at.train(recipe, output_dir=str(tmp_path / "run"), **TINY).run_dir
    cfg = resolve_config(at.get_recipe(recipe).Config, None, TINY)
    model = at.get_recipe(recipe)(cfg).build_model(cfg)
    final = load_file(str(run_dir / "final" / "model.safetensors"))

    model.load_state_dict(final)  # strict: no name missing, none left over

    head, embedding = TIED[recipe]
    assert model.get_parameter(head) is model.get_parameter(embedding)  # still one tensor
    assert torch.equal(final[head], final[embedding])
    exported = load_file(str(export(run_dir, tmp_path / "export") / "model.safetensors"))
    assert exported.keys() == final.keys()
    if recipe == "hf_causal_lm":
        loaded = type(model).from_pretrained(run_dir / "final")
        assert loaded.get_parameter(head) is loaded.get_parameter(embedding)
        assert torch.equal(loaded.get_parameter(head), final[head])
