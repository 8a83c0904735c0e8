"""A base held in 4 bits (accel_trainer/contract/quantization.py): which weights are quantized and how, the
model they stand for, the refusals, and canaries for the two upstream behaviours the module works around."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import accel_trainer as at
from accel_trainer.contract import quantization
from accel_trainer.contract.pretrained import weights_digest
from accel_trainer.parallel.wrapping import check_four_bit_layout
from accel_trainer.processes import free_port
from conftest import clean_env

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
torchao = pytest.importorskip("torchao")


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=96, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("blocks", "size"), [(1024, 128), (5184, 216), (1728, 216), (13824, 216), (8, 1), (9, 9)])
def test_the_scale_block_divides_the_blocks_and_leaves_a_count_that_eight_shards_split_where_it_can(blocks, size):
    # 1,024 blocks: 256 would leave 4 scale blocks, so 128 (8 of them); SmolLM2's 576 x 576 has 5,184 blocks
    assert quantization.scaler_block_size(blocks) == size


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama-linear", "gpt2-conv1d"])
def test_every_linear_weight_but_the_output_head_is_held_in_4_bits_and_stands_for_the_weight(build):
    model, original = build(), build()
    with torch.no_grad():
        expected = original(input_ids=IDS).logits
        at.quantize_base(model, "nf4")
        logits = model(input_ids=IDS).logits
    names = quantization.quantized_names(model)
    assert len(names) == 14 if build is tiny_llama else len(names) == 8  # 7 or 4 linear layers a block
    assert not quantization.is_quantized(model.get_output_embeddings().weight)
    assert all(model.get_parameter(name).requires_grad is False for name in names)
    assert 0 < (logits - expected).abs().max() < 0.25 * expected.abs().max()  # 4 bits: close, not equal
    four_bit = sum(quantization.storage_bytes(model.get_parameter(name)) for name in names)
    full = sum(model.get_parameter(name).numel() * 4 for name in names)
    assert four_bit < full / 7  # half a byte a value, and the scales


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama-linear", "gpt2-conv1d"])
def test_an_adapter_trains_over_4_bits_and_merges_into_the_dequantized_base_to_the_same_logits(build):
    model = at.quantize_base(build(), "nf4")
    conv1d = build is tiny_gpt2
    lora = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights="gaussian", fan_in_fan_out=conv1d)
    tuned = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, parameter in tuned.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)  # an adapter that changes the output
    loss = tuned(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert all(p.grad is not None for p in tuned.parameters() if p.requires_grad)
    with torch.no_grad():
        before = tuned(input_ids=IDS).logits
        merged = quantization.dequantize(tuned).merge_and_unload()
        after = merged(input_ids=IDS).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert not quantization.quantized_names(merged)
    assert all(type(module).__name__ != "NF4Conv1D" for module in merged.modules())  # transformers' Conv1D again


def test_a_weight_not_a_multiple_of_64_values_is_kept_and_named():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(10, 3), nn.Linear(64, 5))
    at.quantize_base(model, "nf4")
    model.requires_grad_(False)
    assert quantization.quantized_names(model) == ["0.weight", "2.weight"]  # 64 x 64 and 5 x 64 values
    assert quantization.kept_in_full_precision(model) == ["1.weight"]  # 3 x 10


def test_the_fingerprint_of_a_4_bit_base_is_of_its_4_bits():
    quantized = dict(at.quantize_base(tiny_llama(), "nf4").named_parameters())
    again = dict(at.quantize_base(tiny_llama(), "nf4").named_parameters())
    plain = dict(tiny_llama().named_parameters())
    assert weights_digest(quantized) == weights_digest(again) != weights_digest(plain)


def test_the_refusals_are_one_line_each(monkeypatch):
    with pytest.raises(at.RecipeError, match="quantize_base=int8: not a scheme accel-trainer knows; use one of"):
        at.quantize_base(tiny_llama(), "int8")
    with pytest.raises(at.RecipeError, match="has no linear layer to quantize"):
        at.quantize_base(nn.Sequential(nn.Embedding(4, 64)), "nf4")
    with pytest.raises(at.ConfigError, match="lora_r=0 trains every weight: give lora_r > 0"):
        at.get_recipe("hf_finetune").Config(quantize_base="nf4", lora_r=0)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(at.RecipeError, match=r"needs torchao .*pip install 'accel-trainer\[quantize\]'"):
        at.quantize_base(tiny_llama(), "nf4")


def test_canary_a_4_bit_weight_keeps_the_device_it_was_handed_where_a_plain_tensor_takes_its_canonical_one():
    # On one GPU accelerate moves the model to `cuda`: plain tensors report `cuda:0`, NF4 weights `cuda`, and a
    # full-state-dict load (a resume) refused the mix. `cpu:0` is the same case on the CPU (canonically `cpu`).
    weight = torch.randn(256, 256)
    assert weight.to("cpu:0").device == torch.device("cpu")
    assert quantization.nf4_constructor()(weight).to("cpu:0").device == torch.device("cpu", 0)


def test_a_4_bit_model_moved_to_an_indexed_device_loads_a_full_state_dict_after_it_is_put_where_plain_tensors_are():
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model = at.quantize_base(tiny_llama(), "nf4").to("cpu:0")
    full = StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(model, options=full)
    with pytest.raises(ValueError, match="Multiple devices found"):
        set_model_state_dict(model, state, options=full)
    quantization.on_the_plain_tensors_device(model)
    assert {parameter.device for parameter in model.parameters()} == {torch.device("cpu")}
    set_model_state_dict(model, state, options=full)


def test_a_4_bit_base_is_refused_on_a_tensor_parallel_mesh_and_where_fsdp_cannot_split_its_blocks():
    model = at.quantize_base(tiny_llama(), "nf4")
    mesh = SimpleNamespace(tp_size=2, cp_size=1, pp_size=1, dp_replicate_size=1, dp_shard_size=1)
    accelerator = SimpleNamespace(parallelism_config=mesh, distributed_type=None, num_processes=2)
    with pytest.raises(at.ConfigError, match=r"trains on one process, DDP, FSDP2 and HSDP, not .*\(tp 2\)"):
        check_four_bit_layout(accelerator, model)
    quantization.check_shardable(model, 8)  # every weight's scale blocks split into 8
    with pytest.raises(at.RecipeError, match=r"on 3 shards: .* do not split into 3 equal parts: .* or use DDP"):
        quantization.check_shardable(model, 3)


def test_canary_ddp_quantizes_a_4_bit_weight_again_when_it_broadcasts_the_model(tmp_path):
    """DDP's start-up broadcast turns a 4-bit weight's scales into others (quantization.kept_out_of_ddp). When
    this fails, DDP leaves them alone: kept_out_of_ddp can go."""
    script = tmp_path / "ddp_broadcast.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from torchao.quantization import to_nf4\n"
        "dist.init_process_group('gloo')\n"
        "torch.manual_seed(0)\n"
        "layer = torch.nn.Linear(64, 64)\n"
        "layer.weight = torch.nn.Parameter(to_nf4(torch.randn(64, 64), 64, 64), requires_grad=False)\n"
        "scales = layer.weight.quantized_scalers.clone()\n"
        "torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(layer, torch.nn.Linear(64, 2)))\n"
        "print('changed' if not torch.equal(scales, layer.weight.quantized_scalers) else 'kept')\n"
        "dist.destroy_process_group()\n"
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    result = subprocess.run([*launcher, str(script)], capture_output=True, text=True, timeout=300, env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("changed") == 2 and "kept" not in result.stdout, result.stdout  # lines may interleave


@pytest.mark.skipif(torch.cuda.is_available(), reason="torchao's CUDA kernels load with CUDA")
def test_canary_importing_torchao_on_a_cpu_build_logs_the_lines_accel_trainer_drops():
    """console/import_noise.py drops these; when this fails, torchao stopped logging them and the filter can go."""
    code = "import logging; logging.basicConfig(); import torchao.quantization"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "Failed to load " in result.stderr and "is an Enum subclass and is now natively" in result.stderr
    quiet = "from accel_trainer.console.import_noise import drop_known_import_noise; drop_known_import_noise(); "
    result = subprocess.run([sys.executable, "-c", quiet + code], capture_output=True, text=True, timeout=300)
    assert "Failed to load " not in result.stderr and "Enum subclass" not in result.stderr, result.stderr
