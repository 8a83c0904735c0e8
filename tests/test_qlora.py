"""QLoRA (`quantize_base=nf4`): a fine-tune's frozen base in 4 bits under a LoRA adapter, on every data layout.

The base is the tiny random Llama with SmolLM2's real tokenizer (conftest's `tiny_base`), the data a JSONL file of
text rows. One process, DDP and FSDP2 train the same adapter (FSDP2 holding each 4-bit weight's shard, still 4-bit);
a checkpoint holds the adapter and the base's fingerprint and resumes bitwise, reading the base once (quantized
as it is read: tests/unit/test_base_loading.py); `final/` is the dequantized base
with the adapter merged, which transformers loads as a plain model with the logits of the 4-bit model that trained;
`estimate` counts the base at its 4-bit size.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import accel_trainer as at
from accel_trainer.contract.quantization import quantized_names
from conftest import (
    BIN,
    COLOURS,
    NAMES,
    clean_env,
    rank_summary,
    reset_accelerate_state,
    run_command,
    train_and_dump,
    write_jsonl,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("torchao")

QLORA = ["quantize_base=nf4", "lora_r=4", "max_steps=6", "block_size=32", "global_batch_size=16", "warmup_steps=2",
         "log_every_steps=1", "eval_every_steps=6", "save_every_steps=3", "lr=3e-3", "micro_batch_size=4"]  # fmt: skip
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # as every layout test's


@pytest.fixture(scope="module")
def text_rows(tmp_path_factory) -> Path:
    rows = [{"text": f"{name} likes {colour}. {name} wears {colour}."} for name in NAMES for colour in COLOURS]
    return write_jsonl(tmp_path_factory.mktemp("qlora_data") / "likes.jsonl", rows)


@pytest.fixture(scope="module")
def one_process(tiny_base, text_rows, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("qlora_one_process")
    train_and_dump("cpu", run, "hf_finetune", f"base={tiny_base}", f"data={text_rows}", *QLORA, world_size=1)
    return run


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["cpu_ddp", "cpu_fsdp"])
def test_qlora_trains_the_adapter_of_one_process_on_ddp_and_on_fsdp_which_keeps_4_bit_shards(
    layout, tiny_base, text_rows, one_process, tmp_path
):
    train_and_dump(layout, tmp_path, "hf_finetune", f"base={tiny_base}", f"data={text_rows}", *QLORA, world_size=2)
    expected, actual = adapter(one_process), adapter(tmp_path)
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    whole = rank_summary(one_process, 0)["four_bit_bytes"]
    held = [rank_summary(tmp_path, rank)["four_bit_bytes"] for rank in (0, 1)]
    assert len(whole) == 14 and all(ranks.keys() == whole.keys() for ranks in held)  # 7 linear layers x 2 blocks
    if layout == "cpu_fsdp":  # each process holds about half of every weight's 4 bits (the scales' mean: both)
        assert all(0.45 < ranks[name] / whole[name] < 0.6 for ranks in held for name in whole)
    else:  # DDP: every process holds the whole 4-bit weight
        assert held == [whole, whole]


def test_a_qlora_checkpoint_holds_the_adapter_and_the_4_bit_bases_fingerprint_and_resumes_bitwise_reading_its_base_once(
    tiny_base, text_rows, one_process, tmp_path, monkeypatch
):
    checkpoint = one_process / "checkpoints" / "step_00000003"
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert weights and all(".lora_A." in name or ".lora_B." in name for name in weights)
    frozen = json.loads((checkpoint / "train_state.json").read_text())["frozen"]
    assert frozen["base"] == str(Path(tiny_base).resolve()) and len(frozen["sha256"]) == 64
    assert sum(path.stat().st_size for path in checkpoint.iterdir()) < (tiny_base / "model.safetensors").stat().st_size
    settings = dict(item.split("=") for item in QLORA)
    reads, read = [], transformers.PreTrainedModel.from_pretrained.__func__
    counted = classmethod(lambda cls, *args, **kwargs: reads.append(cls) or read(cls, *args, **kwargs))
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", counted)
    at.train("hf_finetune", base=str(tiny_base), data=str(text_rows), output_dir=str(tmp_path),
             resume=str(checkpoint), show_progress_bar="False", report="False", **settings)  # fmt: skip
    reset_accelerate_state()
    assert len(reads) == 1  # the model trained: the FLOP count's copy and the final save's are built without weights
    expected, actual = adapter(one_process), adapter(tmp_path)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    merged_expected = load_file(str(one_process / "final" / "model.safetensors"))
    merged_actual = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert all(torch.equal(merged_actual[name], merged_expected[name]) for name in merged_expected)


def test_a_qlora_checkpoint_refuses_the_same_base_in_full_precision_in_one_line(
    tiny_base, text_rows, one_process, tmp_path
):
    settings = dict(item.split("=") for item in QLORA)
    settings.update(quantize_base="none")
    said = "trained on its base .* in 4 bits .*, and this run's is in full precision .*: set quantize_base as"
    with pytest.raises(at.UserError, match=said):
        at.train("hf_finetune", base=str(tiny_base), data=str(text_rows), output_dir=str(tmp_path),
                 resume=str(one_process / "checkpoints" / "step_00000003"), **settings)  # fmt: skip
    reset_accelerate_state()


def test_the_final_folder_is_the_dequantized_base_with_the_adapter_merged_and_gives_the_trained_logits(
    tiny_base, one_process
):
    merged = transformers.AutoModelForCausalLM.from_pretrained(one_process / "final").eval()
    config = json.loads((one_process / "final" / "config.json").read_text())
    assert "quantization_config" not in config and not quantized_names(merged)
    assert all(parameter.dtype == torch.float32 for parameter in merged.parameters())
    base = at.quantize_base(transformers.AutoModelForCausalLM.from_pretrained(tiny_base), "nf4")
    trained = peft.PeftModel.from_pretrained(base, one_process / "final" / "adapter").eval()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        original = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
        assert not torch.allclose(merged(input_ids=ids).logits, original(input_ids=ids).logits)


def test_estimate_counts_the_base_at_its_4_bit_size(tiny_base, text_rows):
    def estimate(*words: str) -> subprocess.CompletedProcess:
        return run_command([BIN / "accel-trainer", "estimate", *words], env=clean_env())

    words = ["hf_finetune", "layout=cpu", f"base={tiny_base}", f"data={text_rows}", "lora_r=4", "block_size=32",
             "micro_batch_size=4", "--json"]  # fmt: skip
    lora = json.loads(estimate(*words).stdout)["per_rank"][0]
    qlora = json.loads(estimate(*words, "quantize_base=nf4").stdout)["per_rank"][0]
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
    linear = sum(m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Linear))
    linear -= base.lm_head.weight.numel()
    held = {id(m.weight): m.weight.numel() for m in (base.get_input_embeddings(), base.get_output_embeddings())}
    halved = 2 * sum(held.values())  # the embedding and head (tied: one tensor) in 16 bits: 2 bytes a value saved
    saved = (
        lora["params_bytes"] - qlora["params_bytes"]
    )  # a float32 weight of n values: 4n bytes, in 4 bits n/2 + scales
    assert 0.85 * 3.5 * linear + halved < saved < 3.5 * linear + halved, (saved, linear, halved)
