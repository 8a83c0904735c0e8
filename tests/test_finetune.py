"""Fine-tuning a pretrained base (recipes/hf_finetune.py, recipes/sft_chat.py): LoRA through peft, or every weight.

The base is this project's own pretrained model (hf_causal_lm's final/, a save_pretrained folder). A LoRA run
and a full fine-tune train to the same weights on 1 process, DDP and FSDP; a LoRA checkpoint holds the adapter,
its optimizer state and the base's fingerprint, not the base (checkpoint/frozen.py), resumes bitwise, and refuses
another base in one line; final/ loads with transformers (merged) and peft (final/adapter) with the same logits;
export and evaluate rebuild the model from the base. The chat recipe trains on the assistant's tokens only, its
packed conversations apart, to the same weights on one process and FSDP.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import accel_trainer as at
from accel_trainer.checkpoint.export import export
from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.commands.evaluate import evaluate_saved, export_run
from accel_trainer.commands.sample import sample
from accel_trainer.errors import UserError
from accel_trainer.observe.flops import flops_per_sample
from conftest import final_parameters, read_metrics, reset_accelerate_state, train_and_dump

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BASE = dict(n_layer=2, n_head=2, d_model=64, block_size=128, max_source_bytes=200_000, max_steps=4, eval_every_steps=0)
FINETUNE = ["max_steps=6", "block_size=32", "max_source_bytes=200000", "global_batch_size=16", "warmup_steps=2",
            "log_every_steps=1", "eval_every_steps=6", "save_every_steps=3", "lr=3e-3"]  # fmt: skip
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # as hf_causal_lm's: micro-batches pad to their own length


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A pretrained model of our own: hf_causal_lm trained a little, its final/ as from_pretrained reads it."""
    run = tmp_path_factory.mktemp("base")
    at.train("hf_causal_lm", output_dir=str(run), show_progress_bar=False, report=False, **BASE)
    reset_accelerate_state()
    return run / "final"


@pytest.fixture(scope="module")
def one_process(base, tmp_path_factory):
    """LoRA (r=4) and full fine-tunes on one process with accumulation (micro-batches of 4)."""
    runs = {}
    for lora_r in (4, 0):
        runs[lora_r] = tmp_path_factory.mktemp(f"finetune_r{lora_r}")
        train_and_dump("cpu", runs[lora_r], "hf_finetune", f"base={base}", f"lora_r={lora_r}", *FINETUNE,
                       "micro_batch_size=4", world_size=1)  # fmt: skip
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["cpu_ddp", "cpu_fsdp"])
@pytest.mark.parametrize("lora_r", [4, 0], ids=["lora", "full"])
def test_a_finetune_trains_to_the_weights_of_one_process_on_ddp_and_fsdp(layout, lora_r, base, one_process, tmp_path):
    # cpu_fsdp loads RAM-efficiently: the main process alone reads the base, the other gets it from the broadcast
    train_and_dump(layout, tmp_path, "finetune_reporting_reads", f"base={base}", f"lora_r={lora_r}", *FINETUNE,
                   "micro_batch_size=4", world_size=2)  # fmt: skip
    reads = [(tmp_path / f"read_base_rank{rank}").read_text() for rank in (0, 1)]
    assert reads == (["True", "False"] if layout == "cpu_fsdp" else ["True", "True"])
    expected, actual = final_parameters(one_process[lora_r]), final_parameters(tmp_path)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)


class SafetensorsReadSpy:
    """A safetensors file that notes every tensor read from it (a slice's `[...]`)."""

    def __init__(self, opened, reads):
        self.opened, self.reads = opened, reads

    def get_slice(self, name):
        real, reads = self.opened.get_slice(name), self.reads

        class Slice:
            def __getitem__(self, index):
                reads.append(name)
                return real[index]

            def __getattr__(self, attribute):
                return getattr(real, attribute)

        return Slice()

    def __getattr__(self, attribute):
        return getattr(self.opened, attribute)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.opened.__exit__(*exc)


def test_the_other_processes_build_a_pretrained_base_reading_nothing_of_its_weights_file_but_the_header(
    base, monkeypatch
):
    """Also the canary of fsdp_loading.weights_unread: transformers 5 reads every tensor of the file even where it
    places the parameter on the meta device; when it stops, the first assertion fails and the stand-in can go."""
    from accelerate import init_empty_weights
    from transformers import modeling_utils

    from accel_trainer.parallel.fsdp_loading import weights_unread

    reads = []
    original = modeling_utils.safe_open
    monkeypatch.setattr(modeling_utils, "safe_open", lambda *a, **k: SafetensorsReadSpy(original(*a, **k), reads))
    with init_empty_weights(include_buffers=False):
        transformers.AutoModelForCausalLM.from_pretrained(base)
    assert reads  # transformers' own way: every tensor read, then dropped on the meta device
    reads.clear()
    with weights_unread(), init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
    assert reads == [] and all(parameter.is_meta for parameter in model.parameters())


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_and_names_the_base(base, one_process):
    checkpoint = one_process[4] / "checkpoints" / "step_00000006"
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert weights and all(".lora_A." in name or ".lora_B." in name for name in weights)
    recorded = json.loads((checkpoint / "train_state.json").read_text())["frozen"]
    assert recorded["base"] == str(base.resolve()) and recorded["parameters"] > 0 and len(recorded["sha256"]) == 64
    size = sum(path.stat().st_size for path in checkpoint.iterdir())
    base_size = (base / "model.safetensors").stat().st_size
    assert size < base_size / 2, (size, base_size)  # the base's weights are not in it
    full_checkpoint = one_process[0] / "checkpoints" / "step_00000006"
    assert "frozen" not in json.loads((full_checkpoint / "train_state.json").read_text())
    assert (
        load_file(str(full_checkpoint / "model.safetensors")).keys()
        >= load_file(str(base / "model.safetensors")).keys()
    )


def test_a_lora_run_and_a_full_finetune_resume_bitwise_and_another_base_is_refused_in_one_line(
    base, one_process, tmp_path
):
    settings = dict(item.split("=") for item in FINETUNE)
    settings.update(micro_batch_size="4", lora_r="4", show_progress_bar="False", report="False")
    resumed = tmp_path / "resumed"
    at.train("hf_finetune", base=str(base), output_dir=str(resumed),
             resume=str(one_process[4] / "checkpoints" / "step_00000003"), **settings)  # fmt: skip
    reset_accelerate_state()
    expected, actual = final_parameters(one_process[4]), final_parameters(resumed)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    settings.update(lora_r="0")  # and a full fine-tune
    at.train("hf_finetune", base=str(base), output_dir=str(tmp_path / "resumed_full"),
             resume=str(one_process[0] / "checkpoints" / "step_00000003"), **settings)  # fmt: skip
    reset_accelerate_state()
    expected, actual = final_parameters(one_process[0]), final_parameters(tmp_path / "resumed_full")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    settings.update(lora_r="4")

    other = tmp_path / "other_base"
    other.mkdir()
    for path in base.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(other / "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = weights[first] + 1e-3
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="trained on other frozen weights .* use the base it was trained from"):
        at.train("hf_finetune", base=str(other), output_dir=str(tmp_path / "wrong"),
                 resume=str(one_process[4] / "checkpoints" / "step_00000003"), **settings)  # fmt: skip
    reset_accelerate_state()


def test_a_lora_runs_weight_average_leaves_out_the_frozen_base_and_resumes_bitwise(base, tmp_path):
    settings = dict(base=str(base), lora_r=4, max_steps=4, save_every_steps=2, block_size=32, ema_decay=0.9,
                    max_source_bytes=200_000, global_batch_size=8, micro_batch_size=8, eval_every_steps=0,
                    show_progress_bar=False, report=False)  # fmt: skip
    at.train("hf_finetune", output_dir=str(tmp_path / "full"), **settings)
    reset_accelerate_state()
    average = load_file(str(tmp_path / "full" / "checkpoints" / "step_00000004" / "ema.safetensors"))
    assert average and all(".lora_A." in name or ".lora_B." in name for name in average)
    at.train("hf_finetune", output_dir=str(tmp_path / "resumed"), **settings,
             resume=str(tmp_path / "full" / "checkpoints" / "step_00000002"))  # fmt: skip
    reset_accelerate_state()
    expected = load_file(str(tmp_path / "full" / "final" / "ema" / "model.safetensors"))
    actual = load_file(str(tmp_path / "resumed" / "final" / "ema" / "model.safetensors"))
    assert expected.keys() == actual.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)


def test_the_final_folder_loads_merged_with_transformers_and_as_an_adapter_with_peft(base, one_process):
    final = one_process[4] / "final"
    merged = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), final / "adapter")
    untouched = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    input_ids = torch.tensor([list(b"def main():\n    return 0\n")])
    with torch.no_grad():
        logits = merged(input_ids).logits
        torch.testing.assert_close(adapted.eval()(input_ids).logits, logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(untouched(input_ids).logits, logits)  # the adapter trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)  # the base's, which its final/ holds
    assert tokenizer("def main():")["input_ids"] == list(b"def main():")


def test_export_and_evaluate_of_a_lora_checkpoint_rebuild_the_model_from_its_base(one_process, tmp_path):
    run = one_process[4]
    with pytest.raises(CheckpointError, match="holds only the trainable weights"):  # not a partial file
        export(run / "checkpoints" / "step_00000006", tmp_path / "partial")
    exported = export_run(run / "checkpoints" / "step_00000006", tmp_path / "exported")
    assert (exported / "adapter" / "adapter_model.safetensors").is_file()
    final, written = load_file(str(run / "final" / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert final.keys() == written.keys() and all(torch.equal(written[name], final[name]) for name in final)

    scores = evaluate_saved(run)
    reset_accelerate_state()
    logged = [record for record in read_metrics(run) if "eval/loss" in record][-1]
    assert scores["eval/loss"] == pytest.approx(logged["eval/loss"], rel=1e-6)


def test_the_export_of_a_full_finetune_is_a_folder_transformers_loads_with_its_tokenizer(one_process, tmp_path):
    run = one_process[0]
    exported = export_run(run / "checkpoints" / "step_00000006", tmp_path / "exported")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    final = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[name], final[name]) for name in final)
    assert transformers.AutoTokenizer.from_pretrained(exported)("def")["input_ids"] == list(b"def")


def test_a_base_that_is_no_model_folder_and_a_negative_rank_are_refused_when_the_config_is_made(base, monkeypatch):
    config = at.get_recipe("hf_finetune").Config
    with pytest.raises(at.ConfigError, match="no such folder or file"):
        config(base=str(base.parent / "nowhere"))
    with pytest.raises(at.ConfigError, match="is not a pretrained model's folder"):
        config(base=str(base.parent / "checkpoints"))
    with pytest.raises(at.ConfigError, match=f"is a run folder; its model is base={base}"):
        config(base=str(base.parent))
    with pytest.raises(at.ConfigError, match="lora_r=-4: must be at least 0"):
        config(base=str(base), lora_r=-4)
    monkeypatch.chdir(base.parent)  # a relative base is kept absolute: the run is read from any folder
    assert config(base="final").base == str(base.resolve())


def test_evaluate_refuses_weights_trained_with_another_tokenizer(one_process, monkeypatch):
    recipe_cls = at.get_recipe("hf_finetune")
    original = recipe_cls.build_tokenizer

    def another_tokenizer(self, cfg):
        tokenizer = original(self, cfg)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
        return tokenizer

    monkeypatch.setattr(recipe_cls, "build_tokenizer", another_tokenizer)
    try:
        with pytest.raises(CheckpointError, match="was trained with another tokenizer"):
            evaluate_saved(one_process[4])
    finally:
        reset_accelerate_state()


def test_the_flops_estimate_leaves_out_the_weight_gradients_of_frozen_weights():
    class Unbuildable(at.Recipe):
        def build_model(self, cfg):
            raise RuntimeError("no model here")

    recipe = Unbuildable(at.TrainConfig())
    batch = torch.zeros(4, 8)
    assert flops_per_sample(recipe, recipe.cfg, batch, 1000)[0] == 6000
    flops, source = flops_per_sample(recipe, recipe.cfg, batch, 1000, frozen_parameters=900)
    assert flops == 6000 - 2 * 900 and "900 frozen" in source


def test_sample_continues_each_prompt_with_the_runs_final_model_and_tokenizer(base, tmp_path):
    greedy = sample(base.parent, ["def ", "import "], max_new_tokens=6, temperature=0)
    assert [text[: len(prompt)] for text, prompt in zip(greedy, ["def ", "import "], strict=True)] == [
        "def ",
        "import ",
    ]
    assert all(len(text.encode()) > len(prompt) for text, prompt in zip(greedy, ["def ", "import "], strict=True))
    assert sample(base.parent, ["def "], max_new_tokens=6, seed=3) == sample(base, ["def "], max_new_tokens=6, seed=3)
    with pytest.raises(UserError, match="has no final/ yet"):
        sample(tmp_path, ["def "])


def test_a_transformers_models_no_split_modules_are_its_blocks_unless_the_recipe_names_its_own(base):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from accel_trainer.parallel.wrapping import block_classes

    recipe = at.get_recipe("hf_finetune")(at.get_recipe("hf_finetune").Config(base=str(base), lora_r=4))
    model = recipe.build_model(recipe.cfg)  # a peft model passes its base's _no_split_modules on
    assert block_classes(recipe, model) == (GPT2Block,)
    recipe.wrap_classes = (torch.nn.Linear,)
    assert block_classes(recipe, model) == (torch.nn.Linear,)


def test_a_transformers_models_declared_tp_plan_is_the_default_in_this_frameworks_styles():
    from accel_trainer.parallel.tensor_parallel import from_transformers_plan
    from accel_trainer.parallel.wrapping import tp_plan_of

    recipe = at.get_recipe("hf_causal_lm")(at.get_recipe("hf_causal_lm").Config())
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    plan = tp_plan_of(recipe, transformers.LlamaForCausalLM(config))
    assert plan["model.embed_tokens"] == "embedding" and plan["lm_head"] == "colwise_gather_output"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    recipe.tp_plan = {"lm_head": "colwise_gather_output"}  # the recipe's own plan wins
    assert tp_plan_of(recipe, transformers.LlamaForCausalLM(config)) == {"lm_head": "colwise_gather_output"}
    with pytest.raises(at.ConfigError, match="'local_colwise', which accel-trainer does not split"):
        from_transformers_plan({"model.layers.*.mlp.up_proj": "local_colwise"})


SFT = ["max_steps=4", "block_size=128", "max_answer_chars=60", "max_source_bytes=150000", "global_batch_size=8",
       "micro_batch_size=4", "warmup_steps=1", "log_every_steps=1", "eval_every_steps=4", "save_every_steps=2",
       "lr=3e-3"]  # fmt: skip


def test_a_chat_batch_targets_the_assistants_tokens_only_and_keeps_packed_conversations_apart(base):
    recipe_cls = at.get_recipe("sft_chat")
    recipe = recipe_cls(
        recipe_cls.Config(base=str(base), block_size=128, max_answer_chars=60, max_source_bytes=150_000)
    )
    recipe.tokenizer = recipe.build_tokenizer(recipe.cfg)
    train, _ = recipe.build_datasets(recipe.cfg)
    batch = recipe.collate([train[0], train[1]])
    tokenizer, ids, targets = recipe.tokenizer, batch["input_ids"], batch["targets"]
    for row in range(2):
        documents = batch["documents"][row]
        for document in documents.unique().tolist():
            if document < 0:  # a window's padding
                continue
            where = (documents == document).nonzero().flatten()
            text = tokenizer.decode(ids[row, where])
            trained = tokenizer.decode(targets[row, where][targets[row, where] != -100])
            assert text.startswith("### Question\nWhat does ") and "\n### Answer\n" in text
            answer = text.split("\n### Answer\n")[1]
            # every token of the answer and its end of text (which the window's last input may not hold)
            assert trained.endswith("<pad>") and trained.removesuffix("<pad>") == answer.removesuffix("<pad>")
            assert batch["positions"][row, where].tolist() == list(range(len(where)))


@pytest.fixture(scope="module")
def chat_one_process(base, tmp_path_factory):
    """sft_chat with LoRA (r=4) and in full on one process, a checkpoint every 2 steps."""
    runs = {}
    for lora_r in (4, 0):
        runs[lora_r] = tmp_path_factory.mktemp(f"chat_r{lora_r}")
        train_and_dump("cpu", runs[lora_r], "sft_chat", f"base={base}", f"lora_r={lora_r}", *SFT, world_size=1)
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "lora_r"), [("cpu_fsdp", 4), ("cpu_ddp", 4), ("cpu_fsdp", 0)],
                         ids=["lora-cpu_fsdp", "lora-cpu_ddp", "full-cpu_fsdp"])  # fmt: skip
def test_a_chat_finetune_trains_to_the_weights_of_one_process_on_ddp_and_fsdp(
    layout, lora_r, base, chat_one_process, tmp_path
):
    train_and_dump(layout, tmp_path, "sft_chat", f"base={base}", f"lora_r={lora_r}", *SFT, world_size=2)
    expected, actual = final_parameters(chat_one_process[lora_r]), final_parameters(tmp_path)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)


def test_a_chat_finetune_resumes_bitwise_and_lowers_the_held_out_assistant_loss_below_the_bases(
    base, chat_one_process, tmp_path
):
    settings = dict(item.split("=") for item in SFT)
    settings.update(base=str(base), lora_r="4", show_progress_bar="False", report="False")
    run = chat_one_process[4]
    at.train("sft_chat", output_dir=str(tmp_path / "resumed"), resume=str(run / "checkpoints" / "step_00000002"),
             **settings)  # fmt: skip
    reset_accelerate_state()
    expected, actual = final_parameters(run), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)

    # The quality bar at this test's scale (a base trained 4 steps, 4 steps of LoRA): the held-out
    # assistant-token loss falls at least 2% below the base's (measured: 5.464 -> 5.275). The README gives it at
    # the recipe's own scale (2.411 -> 1.985 nats).
    settings.update(lr="0", max_steps="1", eval_every_steps="1")  # the adapter starts at zero: the base itself
    at.train("sft_chat", output_dir=str(tmp_path / "base_eval"), **settings)
    reset_accelerate_state()
    base_loss = [r["eval/loss"] for r in read_metrics(tmp_path / "base_eval") if "eval/loss" in r][0]
    tuned_loss = [r["eval/loss"] for r in read_metrics(run) if "eval/loss" in r][-1]
    assert tuned_loss < 0.98 * base_loss, (base_loss, tuned_loss)


def test_a_chat_runs_final_folder_answers_in_its_chat_template_and_its_report_holds_answers(base, chat_one_process):
    one = chat_one_process[4]
    assert (one / "answers.md").read_text().count("- model: ") >= 1  # up to 5 held-out questions
    tokenizer = transformers.AutoTokenizer.from_pretrained(one / "final")
    assert "{% generation %}" in tokenizer.chat_template
    [reply] = sample(one, ["What does abc.ABC do?"], max_new_tokens=8, temperature=0, chat=True)
    question = [{"role": "user", "content": "What does abc.ABC do?"}]
    templated = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert templated.endswith("### Answer\n")
    assert sample(one, [templated], max_new_tokens=8, temperature=0) == [templated + reply]  # the reply alone
    without = transformers.AutoTokenizer.from_pretrained(one / "final")
    without.chat_template = None
    without.save_pretrained(one / "no_template")
    (one / "no_template" / "chat_template.jinja").unlink(missing_ok=True)
    for name in ("config.json", "model.safetensors"):
        (one / "no_template" / name).write_bytes((one / "final" / name).read_bytes())
    with pytest.raises(UserError, match="has no chat template"):
        sample(one / "no_template", ["What does abc.ABC do?"], chat=True)


def test_dpo_after_the_chat_finetune_raises_the_held_out_preference_accuracy(chat_one_process, tmp_path):
    """The demo's preference (recipes/dpo.py): each question's whole answer over the answer cut short. At this
    test's scale (a base of 4 steps, 4 of SFT, 40 of full DPO) the held-out reward accuracy goes from 0 (the
    policy is its reference) to at least 0.8 and the held-out DPO loss falls below log 2 (measured: 1.0, 0.693 ->
    0.29); docs/preference.md gives the recipe's own scale."""
    at.train("dpo", base=str(chat_one_process[4] / "final"), output_dir=str(tmp_path), lora_r=0, lr=2e-4,
             max_steps=40, max_answer_chars=60, max_source_bytes=600_000, global_batch_size=8, eval_fraction=0.25,
             eval_every_steps=40,
             log_every_steps=10, show_progress_bar=False, report=False)  # fmt: skip
    reset_accelerate_state()
    evals = [record for record in read_metrics(tmp_path) if "eval/loss" in record]
    assert [record["step"] for record in evals] == [0, 40]
    assert evals[0]["eval/rewards/accuracies"] == 0.0 and evals[0]["eval/loss"] == pytest.approx(math.log(2))
    assert evals[1]["eval/rewards/accuracies"] >= 0.8, evals[1]
    assert evals[1]["eval/loss"] < 0.95 * math.log(2), evals[1]
    assert "- rejected: " in (tmp_path / "answers.md").read_text()
