"""Preference tuning (recipes/dpo.py): TRL's DPO step, the same weights on every layout, and a bitwise resume.

The model is the tiny random Llama with SmolLM2's real tokenizer and chat template that test_real_models.py
builds; the pairs are files in the forms users keep them (text, and conversations). TRL is a test-only dependency:
its DPOTrainer, on the same model, pairs and hyper-parameters, is the peer whose numbers the recipe matches.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import accel_trainer as at
from accel_trainer import cli
from accel_trainer.data import preference_pairs
from conftest import (
    COLOURS,
    NAMES,
    assert_one_line_error,
    exit_status,
    final_parameters,
    read_metrics,
    reset_accelerate_state,
    train_and_dump,
    write_jsonl,
)

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")


def text_pair(i: int) -> dict:
    name, right, wrong = NAMES[i % 8], COLOURS[i % 6], COLOURS[(i + 3) % 6]
    return {"prompt": f"Which colour does {name} like?", "chosen": f" {name} likes {right}.",
            "rejected": f" {name} likes {wrong}, or maybe something else."}  # fmt: skip


def chat_pair(i: int, implicit: bool = False) -> dict:
    """A conversational pair, every third with a system message; `implicit`: its prompt only begins both
    completions."""
    pair = text_pair(i)
    prompt = [{"role": "user", "content": pair["prompt"]}]
    if i % 3 == 0:
        prompt = [{"role": "system", "content": "Answer briefly."}, *prompt]
    chosen, rejected = ([{"role": "assistant", "content": pair[key].strip()}] for key in ("chosen", "rejected"))
    if implicit:
        return {"chosen": prompt + chosen, "rejected": prompt + rejected}
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


@pytest.fixture(scope="module")
def text_pairs(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", [text_pair(i) for i in range(8)])


@pytest.fixture(scope="module")
def chat_pairs(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "chat_pairs.jsonl", [chat_pair(i) for i in range(32)])


@pytest.fixture(scope="module")
def implicit_pairs(tmp_path_factory) -> Path:
    rows = [chat_pair(i, implicit=True) for i in range(8)]
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "implicit_pairs.jsonl", rows)


PEER = {"max_steps": 2, "global_batch_size": 8, "micro_batch_size": 8, "lr": 1e-3, "warmup_steps": 0,
        "lr_schedule": "constant", "max_grad_norm": 1.0, "weight_decay": 0.0, "log_every_steps": 1,
        "eval_fraction": 0, "seed": 0, "lora_r": 0}  # fmt: skip
LOGGED = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
          "logps/rejected"]  # fmt: skip


def trl_dpo_records(base: Path, pairs: Path, out: Path) -> list[dict]:
    """TRL's DPOTrainer on the same model, pairs and hyper-parameters: the whole set as each step's batch, AdamW
    at a constant LR, no warmup, clipping at 1, float32 on the CPU."""
    import datasets

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    args = trl.DPOConfig(
        output_dir=str(out), per_device_train_batch_size=len(rows), max_steps=PEER["max_steps"],
        learning_rate=PEER["lr"], lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        weight_decay=0.0, optim="adamw_torch", logging_steps=1, bf16=False, use_cpu=True,
        gradient_checkpointing=False, report_to=[], seed=0, beta=0.1, save_strategy="no",
    )  # fmt: skip
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)  # fmt: skip
    trainer.train()
    return [record for record in trainer.state.log_history if "loss" in record]


def dpo_run(out: Path, **settings) -> list[dict]:
    at.train("dpo", output_dir=str(out), show_progress_bar=False, report=False, **settings)
    reset_accelerate_state()
    return [record for record in read_metrics(out) if "loss" in record]


def test_the_first_two_steps_log_trls_loss_and_rewards(tiny_base, text_pairs, tmp_path):
    """The issue asks for 1e-3; the recipe tokenizes, batches and sums as TRL does, so the figures agree to
    float32 rounding (measured: 1e-6)."""
    peer = trl_dpo_records(tiny_base, text_pairs, tmp_path / "trl")
    ours = dpo_run(tmp_path / "ours", base=str(tiny_base), data=str(text_pairs), **PEER)
    assert len(peer) == len(ours) == 2
    for theirs, mine in zip(peer, ours, strict=True):
        for name in LOGGED:
            assert mine[name] == pytest.approx(theirs[name], abs=1e-4), name
    assert ours[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # the policy is its reference at step 1
    assert ours[0]["rewards/accuracies"] == 0.0 and ours[1]["rewards/accuracies"] == 1.0  # strict >, as TRL's
    logits = dpo_run(tmp_path / "logits", base=str(tiny_base), data=str(text_pairs), chunked_loss=False, **PEER)
    for whole, chunked in zip(logits, ours, strict=True):  # the default's chunks are the whole logits' loss;
        # the rewards are beta x differences of log-probabilities near -100: float32's 1e-7 of those, absolute
        assert [chunked[name] for name in LOGGED] == pytest.approx([whole[name] for name in LOGGED], rel=1e-6, abs=1e-6)


def test_pairs_are_tokenized_as_trls_dpo_trainer_tokenizes_them(
    tiny_base, text_pairs, chat_pairs, implicit_pairs, tmp_path
):
    """Text (an end-of-sequence token appended) and conversations (the chat template; a prompt left implicit)."""
    import datasets

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_base)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
    for pairs in (text_pairs, chat_pairs, implicit_pairs):
        rows = datasets.Dataset.from_list([json.loads(line) for line in pairs.read_text().splitlines()])
        args = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
        ours = preference_pairs.tokenized_pairs(rows, tokenizer, "training", 1024, "start")
        for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert ours[column] == trainer.train_dataset[column], (pairs.name, column)


def test_a_pair_is_never_split_and_its_completion_alone_counts():
    batch = preference_pairs.collate_pairs(
        [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5, 6]},
         {"prompt_ids": [7], "chosen_ids": [8, 9], "rejected_ids": [10]}],
        pad_id=0, max_length=None,
    )  # fmt: skip
    assert batch["input_ids"].shape == (2, 2, 5)  # a pair is one sample: chosen and rejected in one row
    flat = preference_pairs.sequences(batch)
    assert flat["input_ids"].tolist() == [[1, 2, 3, 0, 0], [7, 8, 9, 0, 0], [1, 2, 4, 5, 6], [7, 10, 0, 0, 0]]
    assert flat["completion_mask"].tolist() == [[0, 0, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    logits = torch.zeros(4, 5, 11)  # uniform: each completion token has log-probability -log 11
    logps = at.completion_logps(logits, flat["input_ids"], flat["completion_mask"])
    assert logps.tolist() == pytest.approx([-torch.log(torch.tensor(11.0)).item() * n for n in (1, 2, 3, 1)])


MESSAGES = [{"role": "user", "content": "Which colour does Ada like?"}]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "Which colour?", "chosen": " Red.", "rejected": None}, "its rejected is missing (null)"),
        ({"prompt": "Which colour?", "chosen": "  ", "rejected": " Red."}, "its chosen completion is empty"),
        (
            {
                "prompt": MESSAGES,
                "chosen": [{"role": "assistant", "content": "Red."}],
                "rejected": [{"role": "assistant", "content": ""}],
            },
            "its rejected completion is empty",
        ),  # fmt: skip
        ({"prompt": MESSAGES, "chosen": " Red.", "rejected": " Blue."}, None),  # a completion as text: a message
        (
            {"prompt": "Which colour?", "chosen": [{"role": "assistant", "content": "Red."}], "rejected": " Blue."},
            "its prompt is str and its completions list",
        ),  # fmt: skip
    ],
)
def test_a_pair_with_a_missing_or_empty_completion_is_one_line_naming_it(row, message, tiny_base):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_base)
    if message is None:
        assert preference_pairs.tokenize_pair(row, 3, tokenizer, "training")["chosen_ids"]
        return
    with pytest.raises(at.ConfigError, match=r"^training pair 3 \('.+'\): " + re.escape(message)):
        preference_pairs.tokenize_pair(row, 3, tokenizer, "training")


def test_simpo_needs_no_reference_and_is_its_papers_loss():
    chosen, rejected = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    terms = at.preference_terms(chosen, rejected, beta=2.0, loss="simpo", simpo_gamma=0.5)
    expected = -torch.nn.functional.logsigmoid(2.0 * (chosen - rejected) - 0.5)
    torch.testing.assert_close(terms["loss"], expected)
    assert terms["rewards/accuracies"].tolist() == [1.0, 0.0]
    summed = at.preference_loss(terms)
    assert summed["num_items"].item() == 2 and summed["loss"].item() == pytest.approx(expected.sum().item())


SMALL = ["max_steps=4", "global_batch_size=8", "micro_batch_size=2", "warmup_steps=1", "log_every_steps=1",
         "eval_every_steps=4", "save_every_steps=2", "lr=3e-3", "eval_fraction=0.25"]  # fmt: skip
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


VARIANTS = {"lora": ["lora_r=4"], "full": ["lora_r=0"], "precomputed": ["lora_r=0", "precompute_ref=true"]}


@pytest.fixture(scope="module")
def one_process(tiny_base, chat_pairs, tmp_path_factory):
    """DPO on the conversational pairs on one process (4 micro-batches a step): LoRA (r=4), full (a frozen
    reference copy), and full with precomputed reference log-probabilities."""
    runs = {}
    for variant, overrides in VARIANTS.items():
        runs[variant] = tmp_path_factory.mktemp(f"dpo_{variant}")
        train_and_dump("cpu", runs[variant], "dpo", f"base={tiny_base}", f"data={chat_pairs}", *overrides, *SMALL,
                       world_size=1)  # fmt: skip
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "variant"),
    [("cpu_ddp", "lora"), ("cpu_ddp", "full"), ("cpu_fsdp", "lora"), ("cpu_fsdp", "full"), ("cpu_fsdp", "precomputed")],
)
def test_dpo_trains_to_the_weights_and_metrics_of_one_process_on_ddp_and_fsdp(
    layout, variant, tiny_base, chat_pairs, one_process, tmp_path
):
    records = train_and_dump(layout, tmp_path, "dpo", f"base={tiny_base}", f"data={chat_pairs}", *VARIANTS[variant],
                             *SMALL, world_size=2)  # fmt: skip
    expected, actual = final_parameters(one_process[variant]), final_parameters(tmp_path)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    alone = read_metrics(one_process[variant])
    for mine, theirs in zip(records, alone, strict=True):
        for name in [*LOGGED, *(f"eval/{name}" for name in LOGGED)]:
            if name in theirs:
                assert mine[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-5), name


def test_a_full_dpo_keeps_its_reference_out_of_checkpoints_and_final(tiny_base, one_process):
    """The frozen copy is fingerprinted, not saved; final/ is the policy alone, a plain transformers model."""
    from safetensors.torch import load_file

    run = one_process["full"]
    checkpoint = run / "checkpoints" / "step_00000002"
    state = json.loads((checkpoint / "train_state.json").read_text())
    assert state["frozen"]["parameters"] > 0
    saved = load_file(str(next(checkpoint.rglob("model*.safetensors"))))
    assert saved and not any("reference" in name for name in saved)
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "final")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (run / "answers.md").read_text().count("- chosen:") == 5
    scores = at.evaluate_saved(run)  # final/: the policy, against the base as its reference
    reset_accelerate_state()
    last = [record for record in read_metrics(run) if "eval/loss" in record][-1]
    assert scores["eval/loss"] == pytest.approx(last["eval/loss"], abs=1e-5)


@pytest.mark.parametrize("variant", ["lora", "full"])
def test_dpo_resumes_bitwise(variant, tiny_base, chat_pairs, one_process, tmp_path):
    settings = dict(item.split("=") for item in [*SMALL, *VARIANTS[variant]])
    settings.update(base=str(tiny_base), data=str(chat_pairs))
    run = one_process[variant]
    resumed = dpo_run(tmp_path, resume=str(run / "checkpoints" / "step_00000002"), **settings)
    expected, actual = final_parameters(run), final_parameters(tmp_path)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in read_metrics(run) if "loss" in r and r["step"] > 2]


def test_precomputed_reference_log_probabilities_train_as_the_reference_does_cached_and_checked_on_resume(
    tiny_base,
    text_pairs,
    tmp_path,
    monkeypatch,
    capsys,
):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    live = dpo_run(tmp_path / "live", base=str(tiny_base), data=str(text_pairs), **PEER)
    cached = dpo_run(tmp_path / "cached", base=str(tiny_base), data=str(text_pairs), precompute_ref=True, **PEER)
    assert "the reference's log-probabilities of 8 pairs computed in" in capsys.readouterr().out
    for mine, theirs in zip(cached, live, strict=True):
        for name in LOGGED:
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name
    (cache_file,) = (tmp_path / "cache" / "accel_trainer_reference_logps").glob("*.safetensors")
    settings = {**PEER, "max_steps": 4, "save_every_steps": 2}
    first = dpo_run(tmp_path / "first", base=str(tiny_base), data=str(text_pairs), precompute_ref=True, **settings)
    assert "the reference's log-probabilities of 8 pairs read from" in capsys.readouterr().out  # the cache
    resumed = dpo_run(tmp_path / "resumed", base=str(tiny_base), data=str(text_pairs), precompute_ref=True,
                      resume=str(tmp_path / "first" / "checkpoints" / "step_00000002"), **settings)  # fmt: skip
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first if r["step"] > 2]
    other_pairs = write_jsonl(tmp_path / "other.jsonl", [text_pair(i + 1) for i in range(8)])
    with pytest.raises(at.UserError, match="reference_logps"):
        dpo_run(tmp_path / "other", base=str(tiny_base), data=str(other_pairs), precompute_ref=True,
                resume=str(tmp_path / "first" / "checkpoints" / "step_00000002"), **settings)  # fmt: skip
    reset_accelerate_state()
    assert cache_file.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss=simpo", "precompute_ref=true"], "SimPO has no reference"),
        (["beta=0"], "beta=0"),
        (["max_length=600"], "max_length=600 is longer than the base's context, 512"),
        (["data=MISSING"], "MISSING"),
    ],
)
def test_a_preference_mistake_is_one_line(overrides, message, tiny_base, text_pairs, tmp_path, capsys):
    data = [o for o in overrides if o.startswith("data=")] or [f"data={text_pairs}"]
    rest = [o for o in overrides if not o.startswith("data=")]
    arguments = ["train", "dpo", f"base={tiny_base}", *data, *rest, f"output_dir={tmp_path}"]
    assert_one_line_error(exit_status(cli.main, arguments), capsys.readouterr().err, message)


def test_canary_transformers_reads_a_mask_value_that_a_meta_tensor_refuses(tiny_base):
    """transformers reads whether a padding mask holds padding (and whether positions are packed) as a value,
    which a meta tensor refuses: the FLOP count's meta copy answers such reads with 1 (observe/flops.py
    `_MetaScalarsAreOne`). Fails the day transformers reads no value there; the regression is below."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny_base))
    model.config.pad_token_id = None
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match=r"item\(\) cannot be called on meta tensors"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)


@pytest.mark.parametrize("variant", ["lora", "full"])
def test_the_flops_of_a_dpo_step_are_counted_with_the_reference_forward(variant, tiny_base, text_pairs):
    from accel_trainer.observe.flops import flops_per_sample

    recipe_cls = at.get_recipe("dpo")
    cfg = recipe_cls.Config(base=str(tiny_base), data=str(text_pairs), lora_r=4 if variant == "lora" else 0)
    recipe = recipe_cls(cfg)
    recipe.tokenizer = recipe.build_tokenizer(cfg)
    recipe.build_model(cfg)  # its max_length
    train, _ = recipe.build_datasets(cfg)
    flops, source = flops_per_sample(recipe, cfg, recipe.collate([train[0], train[1]]), 1000)
    assert source == "counted by FlopCounterMode, forward + backward" and flops > 0
