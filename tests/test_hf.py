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

from conftest import final_parameters, read_metrics, train_and_dump

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
    [("cpu", []), ("cpu_ddp", []), ("cpu_fsdp", []), ("cpu_fsdp", ["activation_checkpointing=true"])],
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


@pytest.fixture(scope="module")
def own_loss_big_batch(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_own_loss_big_batch")
    train_and_dump("cpu", out, "hf_causal_lm", *HF, "own_loss=true", "micro_batch_size=16", world_size=1)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "world_size"), [("cpu", 1), ("cpu_ddp", 2)], ids=["accumulation", "ddp"])
def test_the_models_own_loss_trains_to_the_weights_and_losses_of_one_big_batch(
    layout, world_size, own_loss_big_batch, tmp_path
):
    """`return model(**batch).loss` is a mean over each micro-batch's tokens unless the model is given the step's
    token count: the loop counts the labels of the step's micro-batches on every process first and passes it."""
    records = train_and_dump(layout, tmp_path, "hf_causal_lm", *HF, "own_loss=true", "micro_batch_size=4",
                             world_size=world_size)  # fmt: skip

    expected, actual = final_parameters(own_loss_big_batch), final_parameters(tmp_path)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    big = [r["loss"] for r in read_metrics(own_loss_big_batch) if "loss" in r]
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(big, rel=1e-5)


def test_labels_other_than_the_batchs_are_refused_and_a_batch_without_labels_is_warned_about(tmp_path):
    import accel_trainer as at
    from accel_trainer.errors import RecipeError

    base = at.get_recipe("hf_causal_lm")
    options = dict(max_steps=1, n_layer=1, n_head=2, d_model=16, block_size=16, global_batch_size=8,
                   micro_batch_size=4, eval_every_steps=0, max_source_bytes=20000, show_progress_bar=False,
                   report=False)  # fmt: skip

    @at.register_recipe("hf_own_loss_other_labels")
    class OtherLabels(base):
        def compute_loss(self, model, batch):
            labels = batch["labels"].clone()
            labels[:, :4] = -100  # fewer targets than the batch's labels count
            return model(input_ids=batch["input_ids"], labels=labels).loss

    with pytest.raises(RecipeError, match=r"compute_loss passed the model labels with \d+ items, but the batch's"):
        at.train("hf_own_loss_other_labels", output_dir=str(tmp_path / "other"), own_loss=True, **options)

    @at.register_recipe("hf_own_loss_no_labels")
    class NoLabels(base):
        def collate(self, examples):
            return {k: v for k, v in super().collate(examples).items() if k != "labels"}

        def compute_loss(self, model, batch):  # labels made here: nothing to count before the forward
            return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    with pytest.warns(UserWarning, match=r"the model computes its own loss from labels.* at.token_cross_entropy"):
        at.train("hf_own_loss_no_labels", output_dir=str(tmp_path / "none"), own_loss=True, **options)


@pytest.mark.parametrize("form", ["positions alone", "bool mask"])
def test_a_packed_window_reads_each_paragraph_as_if_it_were_alone(form):
    """pack_sequences=true: positions restart and attention stays within each paragraph of a window, as in the
    GPT recipe: transformers' GPT-2 gets the positions alone (use_cache=False: it finds the paragraphs itself), or
    positions and a 4-D mask (a model that does not take the positions alone: tests/test_packed_positions.py)."""
    import sys

    import accel_trainer as at

    recipe_cls = at.get_recipe("hf_causal_lm")
    recipe = recipe_cls(recipe_cls.Config(n_layer=2, n_head=2, d_model=32, block_size=16, pack_sequences=True))
    model = recipe.build_model(recipe.cfg).eval()
    module = sys.modules[recipe_cls.__module__]
    assert recipe.packing.form == module.POSITIONS  # measured when built: transformers 5's GPT-2 takes positions
    first, second = list(b"def f():"), list(b"x = 12;\n\n")  # 8 + 9 bytes: a window of block_size + 1
    batch = recipe.collate([{"input_ids": first + second, "documents": [0] * 8 + [1] * 9}])
    inputs = module.model_inputs(batch, module.Packing(form))
    assert ("attention_mask" in inputs) is (form != module.POSITIONS)
    with torch.no_grad():
        packed = model(**inputs).logits
        alone = [model(input_ids=torch.tensor([ids])).logits for ids in (first, second[:-1])]
    torch.testing.assert_close(packed[:, :8], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 8:], alone[1], rtol=1e-5, atol=1e-5)


def test_a_model_of_other_code_than_transformers_gets_the_4d_mask():
    """A Llama is measured to keep packed sequences apart by positions alone; a model that is not transformers'
    cannot be measured (no `get_input_embeddings`), nor is its architecture known: it gets the bool 4-D mask."""
    import sys

    import accel_trainer as at

    hf_causal_lm = sys.modules[at.get_recipe("hf_causal_lm").__module__]
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    llama = transformers.LlamaForCausalLM(config)
    assert hf_causal_lm.packs_by_positions(llama) and not hf_causal_lm.packs_by_positions(torch.nn.Linear(2, 2))
    assert hf_causal_lm.assumed_packing(torch.nn.Linear(2, 2)).form == hf_causal_lm.BOOL_MASK


def test_canary_transformers_lets_packed_sequences_attend_to_each_other_given_position_ids_and_a_cache():
    """hf_causal_lm's model_inputs passes `use_cache=False` beside the restarted positions: with a cache (the
    config's default use_cache=True), transformers' GPT-2 (sdpa) skips its search for packed sequences and lets one
    attend to the one before it. Fails the day position_ids keep packed sequences apart with a cache too."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=257, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2)).eval()  # fmt: skip
    first, second = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 7))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions).logits
        without_cache = model(input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False).logits
        alone = model(input_ids=second).logits
    assert not torch.allclose(packed[:, 5:], alone, atol=1e-4)
    torch.testing.assert_close(without_cache[:, 5:], alone, rtol=1e-5, atol=1e-5)


def test_canary_from_pretrained_refuses_a_meta_default_device(tmp_path):
    """observe/flops.py builds a from_pretrained model under accelerate's init_empty_weights for the FLOP count:
    transformers refuses torch.device("meta"), which builds every other model without weights. Fails the day it
    takes it, and the fallback can go."""
    config = transformers.GPT2Config(vocab_size=257, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="from_pretrained"), torch.device("meta"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
