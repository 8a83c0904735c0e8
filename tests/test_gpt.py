"""The byte-level GPT recipe: a deterministic variable-length corpus, padding that costs nothing, real training."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch

import accel_trainer as at
from conftest import read_metrics

TINY = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 64, "max_source_bytes": 200_000}


def recipe_and_config(**overrides):
    recipe_cls = at.get_recipe("gpt")
    cfg = recipe_cls.Config(**{**TINY, **overrides})
    return recipe_cls(cfg), cfg


def gpt_module():
    import sys

    return sys.modules[at.get_recipe("gpt").__module__]


def test_the_corpus_is_sorted_stdlib_modules_within_the_byte_cap():
    files = [Path(f) for f in gpt_module().source_files(max_source_bytes=300_000)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files)
    assert all(f.parent == stdlib and "a" <= f.name[0] <= "m" and f.suffix == ".py" for f in files)
    assert 0 < sum(f.stat().st_size for f in files) <= 300_000


def test_a_long_paragraph_is_cut_into_chunks_of_block_size_plus_one_that_overlap_by_one_byte():
    chunks = gpt_module().chunk_paragraphs({"text": ["abcdefghij", "x", "yz"]}, block_size=4)["input_ids"]
    assert [bytes(c) for c in chunks] == [b"abcde", b"efghi", b"ij", b"yz"]  # "x" predicts nothing: dropped


def test_the_dataset_is_deterministic_and_its_sequences_vary_in_length():
    recipe, cfg = recipe_and_config()
    train, eval_ = recipe.build_datasets(cfg)
    train_again, eval_again = recipe.build_datasets(cfg)
    assert train["input_ids"] == train_again["input_ids"]
    assert eval_["input_ids"] == eval_again["input_ids"]
    lengths = {len(ids) for ids in train["input_ids"]}
    assert min(lengths) >= 2 and max(lengths) == cfg.block_size + 1 and len(lengths) > cfg.block_size // 2
    assert 0.02 < len(eval_) / (len(train) + len(eval_)) < 0.1  # eval_fraction of the paragraphs, 0.05


def test_a_data_cache_dir_keeps_the_cut_examples_for_later_runs_and_changes_nothing(tmp_path):
    in_memory = recipe_and_config()
    recipe, cfg = recipe_and_config(data_cache_dir=str(tmp_path))
    train, eval_ = recipe.build_datasets(cfg)
    written = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*.arrow")}
    train_again, eval_again = recipe.build_datasets(cfg)  # a later run: read from the cache

    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*.arrow")} == written  # nothing rebuilt
    assert train_again.cache_files and {Path(f["filename"]) for f in train_again.cache_files} <= set(written)
    expected_train, expected_eval = in_memory[0].build_datasets(in_memory[1])
    assert train_again["input_ids"] == train["input_ids"] == expected_train["input_ids"]
    assert eval_again["input_ids"] == eval_["input_ids"] == expected_eval["input_ids"]


def test_collate_pads_to_the_longest_sequence_rounded_up_to_8_and_the_loss_ignores_the_padding():
    """Lengths are multiples of 8 so sequence parallelism can split them evenly over up to 8 processes."""
    recipe, cfg = recipe_and_config()
    sequences = [torch.tensor(list(b"def f(x):\n    return x\n")), torch.tensor(list(b"pass")), torch.tensor([7, 9])]
    batch = recipe.collate([{"input_ids": s} for s in sequences])
    longest = len(sequences[0]) - 1
    padded = -(-longest // 8) * 8

    assert padded > longest  # the example exercises the rounding
    assert batch["input_ids"].shape == batch["targets"].shape == (3, padded)
    assert batch["input_ids"][1].tolist() == list(b"pas") + [gpt_module().PAD_ID] * (padded - 3)
    assert batch["targets"][2].tolist() == [9] + [-100] * (padded - 1)

    torch.manual_seed(0)
    model = recipe.build_model(cfg).eval()
    whole = recipe.compute_loss(model, batch)
    one_by_one = [recipe.compute_loss(model, recipe.collate([{"input_ids": s}])) for s in sequences]
    assert int(whole["num_items"]) == sum(len(s) - 1 for s in sequences) == sum(int(o["num_items"]) for o in one_by_one)
    torch.testing.assert_close(whole["loss"], sum(o["loss"] for o in one_by_one))


def test_eval_metrics_are_per_sequence_sums_with_bits_per_char_the_loss_in_bits():
    recipe, cfg = recipe_and_config()
    sequences = [torch.tensor(list(b"import os\n")), torch.tensor(list(b"x = 1"))]
    batch = recipe.collate([{"input_ids": s} for s in sequences])
    torch.manual_seed(0)
    model = recipe.build_model(cfg).eval()

    metrics = recipe.eval_metrics(model, batch)

    (loss, tokens), (bits, bit_tokens) = metrics["loss"], metrics["bits_per_char"]
    assert tokens.tolist() == bit_tokens.tolist() == [len(s) - 1 for s in sequences]
    torch.testing.assert_close(bits, loss / math.log(2))
    torch.testing.assert_close(loss.sum(), recipe.compute_loss(model, batch)["loss"])


def test_a_short_run_lowers_eval_bits_per_char(tmp_path):
    at.train(
        "gpt",
        **TINY,
        max_steps=40,
        global_batch_size=16,
        micro_batch_size=8,
        lr=3e-3,
        warmup_steps=5,
        eval_every_steps=40,
        log_every_steps=20,
        output_dir=str(tmp_path),
        show_progress_bar=False,
        report=False,
    )

    evals = [r for r in read_metrics(tmp_path) if "eval/bits_per_char" in r]
    assert [r["step"] for r in evals] == [0, 40]
    assert evals[0]["eval/bits_per_char"] == pytest.approx(8.0, abs=0.5)  # near a uniform guess over 256 bytes
    assert evals[-1]["eval/bits_per_char"] < evals[0]["eval/bits_per_char"] - 2.0
    assert evals[-1]["eval/loss"] == pytest.approx(evals[-1]["eval/bits_per_char"] * math.log(2))
    assert (tmp_path / "samples.txt").read_text().startswith("def ")


def packed_window(first: bytes, second: bytes) -> dict:
    """One packed window holding two paragraphs, as pack_paragraphs makes it."""
    packed = gpt_module().pack_paragraphs({"text": [first.decode(), second.decode()]},
                                          block_size=len(first) + len(second) - 1)  # fmt: skip
    assert len(packed["input_ids"]) == 1
    return {"input_ids": packed["input_ids"][0], "documents": packed["documents"][0]}


def test_packing_lays_paragraphs_end_to_end_and_restarts_positions_and_targets_at_each():
    example = packed_window(b"abcde", b"xyz")
    assert example["input_ids"] == list(b"abcdexyz") and example["documents"] == [0] * 5 + [1] * 3
    batch = gpt_module().collate_packed([example])
    assert batch["input_ids"][0].tolist() == list(b"abcdexy")
    assert batch["targets"][0].tolist() == [*b"bcde", -100, *b"yz"]  # "e" -> "x" crosses paragraphs: ignored
    assert batch["positions"][0].tolist() == [0, 1, 2, 3, 4, 0, 1]


def test_a_packed_paragraph_never_attends_to_the_one_before_it():
    recipe, cfg = recipe_and_config(pack_sequences=True, n_layer=2)
    torch.manual_seed(0)
    model = recipe.build_model(cfg).eval()
    batch = gpt_module().collate_packed(
        [packed_window(b"def f(x):", b"return 1"), packed_window(b"class A: ", b"return 1")]
    )
    logits = gpt_module().forward(model, batch)
    second = batch["documents"][0] == 1  # the second paragraph, identical in both windows
    assert not torch.equal(logits[0, ~second], logits[1, ~second])  # the first paragraphs differ
    torch.testing.assert_close(logits[0, second], logits[1, second], rtol=0, atol=0)  # and reach nothing after


def test_canary_flex_attention_has_no_backward_on_the_cpu():
    """recipes/gpt.py's document_attention uses flex_attention on a GPU and the dense mask on the CPU, because
    torch's flex_attention cannot train there. Fails the day it can: then the CPU twin may run the GPU's kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(1, 1, 8, 4, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, k, v).sum().backward()


def test_packing_trains_with_next_to_no_padding_and_streaming_resumes_bitwise_mid_stream(tmp_path):
    run = dict(**TINY, pack_sequences=True, streaming=True, max_steps=8, global_batch_size=8, micro_batch_size=4,
               log_every_steps=1, eval_every_steps=0, save_every_steps=4, keep_last=0,
               show_progress_bar=False, report=False)  # fmt: skip
    at.train("gpt", **run, output_dir=str(tmp_path / "full"))
    at.train("gpt", **run, output_dir=str(tmp_path / "resumed"),
             resume=str(tmp_path / "full" / "checkpoints" / "step_00000004"))  # fmt: skip
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert [r["loss"] for r in full if r.get("step", 0) > 4 and "loss" in r] == [
        r["loss"] for r in resumed if "loss" in r]  # fmt: skip
    assert all(r["padded_per_token"] < 0.02 for r in full if "padded_per_token" in r)
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / run_dir / "final" / "model.safetensors")) for run_dir in ("full", "resumed"))
    assert all(torch.equal(a[name], b[name]) for name in a)
