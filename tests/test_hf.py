"""A Hugging Face transformers model as a recipe's model (recipes/hf_causal_lm.py: GPT-2 from a config).

Its exact token loss (`at.token_cross_entropy` on `out.logits`) trains to the weights of one big batch on 1
process with accumulation, DDP and FSDP (its GPT2Blocks sharded as units), also with the model's own
gradient checkpointing; `final/` is a `save_pretrained` folder that `from_pretrained` loads with the logits
of the trained weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import final_parameters, slow, train_and_dump

transformers = pytest.importorskip("transformers")

HF = ["max_steps=8", "n_layer=2", "n_head=2", "d_model=32", "block_size=32", "global_batch_size=16",
      "log_every_steps=1", "eval_every_steps=0", "warmup_steps=2", "lr=3e-3", "max_source_bytes=200000"]  # fmt: skip
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # as the GPT's: micro-batches pad to their own length


@pytest.fixture(scope="module")
def one_big_batch(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_big_batch")
    train_and_dump("cpu", out, "hf_causal_lm", *HF, "micro_batch_size=16", world_size=1)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "extra"),
    [("cpu", []), slow("cpu_ddp", []), ("cpu_fsdp", []), slow("cpu_fsdp", ["activation_checkpointing=true"])],
    ids=["accumulation", "ddp", "fsdp", "fsdp-gradient-checkpointing"],
)
def test_a_transformers_model_trains_to_the_weights_of_one_big_batch(layout, extra, one_big_batch, tmp_path):
    train_and_dump(layout, tmp_path, "hf_causal_lm", *HF, "micro_batch_size=4", *extra,
                   world_size=1 if layout == "cpu" else 2)  # fmt: skip

    expected, actual = final_parameters(one_big_batch), final_parameters(tmp_path)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)


@pytest.mark.multiprocess
def test_the_final_folder_loads_with_from_pretrained_and_gives_the_trained_logits(one_big_batch):
    import accel_trainer as at

    loaded = transformers.AutoModelForCausalLM.from_pretrained(one_big_batch / "final").eval()
    recipe_cls = at.get_recipe("hf_causal_lm")
    recipe = recipe_cls(recipe_cls.Config(n_layer=2, n_head=2, d_model=32, block_size=32))
    trained = recipe.build_model(recipe.cfg)
    trained.load_state_dict(load_file(str(one_big_batch / "checkpoints" / "step_00000008" / "model.safetensors")))
    input_ids = torch.tensor([list(b"def main():\n    return 0\n")])

    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, trained.eval()(input_ids).logits)
