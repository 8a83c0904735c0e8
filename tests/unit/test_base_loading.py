"""A pretrained base read one tensor at a time (accel_trainer/contract/loading.py, `load_base_model`): a QLoRA base
quantized as it is read holds the 4 bits that quantizing the whole base afterwards gives, and never the whole base
in full precision; a GGUF file read one tensor at a time gives transformers' own whole-file read; a model built
where parameters get no memory reads no weight. Canaries for the two upstream behaviours the module works around.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import init_empty_weights

import accel_trainer as at
from accel_trainer.contract import loading, pretrained, quantization
from conftest import clean_env

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("torchao")


def tiny_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).to(dtype)


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=96, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    models = {"llama": tiny_llama(), "llama-bf16": tiny_llama(torch.bfloat16), "gpt2-conv1d": tiny_gpt2()}
    for name, model in models.items():
        model.save_pretrained(root / name)
    return {name: root / name for name in models}


def assert_same_model(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    """Same classes, config, mode, tensors (a 4-bit weight: the same packed values and scales) and ties."""
    assert [type(m) for m in actual.modules()] == [type(m) for m in expected.modules()]
    assert actual.config.to_dict() == expected.config.to_dict() and actual.training == expected.training
    assert actual.generation_config.to_dict() == expected.generation_config.to_dict()
    expected_tensors = dict(expected.named_parameters(remove_duplicate=False)) | dict(expected.named_buffers())
    actual_tensors = dict(actual.named_parameters(remove_duplicate=False)) | dict(actual.named_buffers())
    assert actual_tensors.keys() == expected_tensors.keys()
    for name, tensor in expected_tensors.items():
        assert quantization.is_quantized(actual_tensors[name]) == quantization.is_quantized(tensor), name
        assert actual_tensors[name].dtype == tensor.dtype, name
        parts = zip(quantization.stored_parts(tensor), quantization.stored_parts(actual_tensors[name]), strict=True)
        assert all(torch.equal(a, b) for a, b in parts), name
    assert actual.get_output_embeddings().weight is actual.get_input_embeddings().weight


@pytest.mark.parametrize("name", ["llama", "llama-bf16", "gpt2-conv1d"])
def test_a_qlora_base_quantized_as_it_is_read_holds_the_4_bits_of_the_whole_base_quantized_afterwards(folders, name):
    expected = at.quantize_base(transformers.AutoModelForCausalLM.from_pretrained(folders[name]), "nf4")
    actual = at.load_base_model(str(folders[name]), quantize="nf4")
    assert_same_model(expected, actual)
    assert len(quantization.quantized_names(actual)) == (8 if name == "gpt2-conv1d" else 14)
    assert not actual.is_quantized and getattr(actual.config, "quantization_config", None) is None  # plain to peft
    assert at.quantize_base(actual, "nf4") is actual and len(quantization.quantized_names(actual)) > 0  # kept


PEAK_AFTER = """
import gc, sys, accel_trainer as at
def peak_kib():  # the process's peak resident memory since the last reset (VmHWM)
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
at.load_base_model(sys.argv[2], quantize="nf4")  # every module imported, every first-use cache filled
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # the peak reset to the memory held now
before = peak_kib()
model = at.load_base_model(sys.argv[1], quantize="nf4")
print((peak_kib() - before) * 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak resident memory (Linux)")
def test_a_qlora_base_read_never_holds_its_full_precision_linear_weights_at_once(folders, tmp_path):
    """48 layers, 147 MiB of float32 linear weights, read and quantized in a fresh process: its peak resident
    memory grows by 0.38 of that (the 4-bit weights, the embedding, one weight's quantizing), where quantizing the
    whole base after reading it, or reading it mapped, or keeping glibc's freed blocks grew by 1.27-1.33 of it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=48,
                                      num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    linear_bytes = sum(module.weight.nbytes for module in quantization.linear_layers(model))
    model.save_pretrained(tmp_path / "base")
    del model
    arguments = [sys.executable, "-c", PEAK_AFTER, str(tmp_path / "base"), str(folders["llama"])]
    result = subprocess.run(arguments, capture_output=True, text=True, timeout=300, env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    grown = int(result.stdout.split()[-1])
    assert grown < 0.6 * linear_bytes, (grown / 2**20, linear_bytes / 2**20)


def tiny_gguf(path: Path) -> Path:
    """A random 2-layer Llama as llama.cpp writes one: Q8_0 and Q4_1 blocks, float32 norms, no output head (tied)."""
    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv, vocab = 64, 128, 4, 2, 96
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(2)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    q8, q4, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32
    shapes = {"token_embd.weight": ((vocab, hidden), q8), "output_norm.weight": ((hidden,), f32)}
    for i in range(2):
        square, kv_rows, up, down = (hidden, hidden), (kv * 16, hidden), (ffn, hidden), (hidden, ffn)
        block = {"attn_norm": ((hidden,), f32), "ffn_norm": ((hidden,), f32), "attn_q": (square, q4),
                 "attn_k": (kv_rows, q8), "attn_v": (kv_rows, q8), "attn_output": (square, q8),
                 "ffn_gate": (up, q4), "ffn_up": (up, q8), "ffn_down": (down, q8)}  # fmt: skip
        shapes |= {f"blk.{i}.{name}.weight": shape for name, shape in block.items()}
    for name, (shape, kind) in shapes.items():
        values = (rng.standard_normal(shape) * 0.05).astype("float32")
        if kind == f32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_gguf_read(path: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    return pretrained.plain_after_gguf(model, str(path))


def test_canary_a_gguf_file_read_one_tensor_at_a_time_is_transformers_own_whole_file_read(tmp_path, monkeypatch):
    """loading.gguf_stream repeats transformers' legacy GGUF read tensor by tensor (dequantizing, its Llama
    processor's reordering of q and k); the day transformers reads Llama otherwise, this fails and the stream is
    revisited. An architecture whose processor is not one-to-one is read by transformers whole."""
    path = tiny_gguf(tmp_path / "tiny.gguf")
    expected = transformers_gguf_read(path)
    assert_same_model(expected, at.load_base_model(str(path)))
    assert_same_model(at.quantize_base(transformers_gguf_read(path), "nf4"), at.load_base_model(str(path), "nf4"))
    with init_empty_weights(include_buffers=False):  # recorded under the file, which peft writes into an adapter
        assert at.load_base_model(str(path)).name_or_path == str(path) == expected.name_or_path
    monkeypatch.setattr(loading, "ONE_TO_ONE", ())
    assert loading.gguf_stream(str(path), expected) is None
    assert_same_model(at.quantize_base(transformers_gguf_read(path), "nf4"), at.load_base_model(str(path), "nf4"))


def test_a_base_built_where_parameters_get_no_memory_reads_no_weight_and_keeps_its_buffers(folders, monkeypatch):
    from transformers import modeling_utils

    opened = []
    original = modeling_utils.safe_open
    monkeypatch.setattr(modeling_utils, "safe_open", lambda *a, **k: opened.append(a) or original(*a, **k))
    with init_empty_weights(include_buffers=False):  # the final save's copy, FSDP's other processes
        model = at.load_base_model(str(folders["llama"]), quantize="nf4")
    assert opened == [] and all(parameter.is_meta for parameter in model.parameters())
    assert all(not buffer.is_meta for buffer in model.buffers()) and not model.training
    assert pretrained.base_source(model) == model.name_or_path == str(folders["llama"])


def mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings (Linux)")
def test_canary_transformers_maps_a_safetensors_file_into_memory_and_pread_files_reads_it_instead(folders):
    """A mapped page read counts in the process's resident memory for as long as the mapping lives (loading.py's
    `pread_files`); the day transformers stops mapping its files, the block can go."""
    weights = str(folders["llama"] / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    assert weights in mapped_files()  # the embedding is a view into the mapped file
    del model
    gc.collect()
    with loading.pread_files():
        model = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    assert weights not in mapped_files()
    assert_same_model(transformers.AutoModelForCausalLM.from_pretrained(folders["llama"]), model)
