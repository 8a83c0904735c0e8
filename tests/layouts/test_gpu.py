"""CUDA-only paths: fp16 with its gradient scaler, bf16, fp8, QLoRA, FSDP on GPUs. Skipped cleanly without a GPU.

make test PYTEST_ARGS="-m gpu -s"      # on a machine with one or more CUDA GPUs
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import (
    BIN,
    REPO,
    TEST_OVERRIDES,
    TWO_PROCESS_CP_LAYOUT,
    WORKERS,
    dump_env,
    final_parameters,
    free_port,
    rank_summary,
    read_metrics,
    reset_accelerate_state,
    run_command,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
QUICK_GPT = ["n_layer=2", "d_model=64", "block_size=64", "log_every_steps=10", "eval_every_steps=0",
             "global_batch_size=32", "micro_batch_size=8"]  # fmt: skip


def launch_on_gpus(layout: str, out, recipe: str, *overrides: str, num_processes: int = 1) -> list[dict]:
    run_command(
        [BIN / "accelerate", "launch", "--config_file", REPO / "accelerate_configs" / f"{layout}.yaml",
         "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
         WORKERS / "train_and_dump.py", recipe, f"output_dir={out}", *overrides, *TEST_OVERRIDES],
        env=dump_env(out, num_processes),
    )  # fmt: skip
    return read_metrics(out)


def training_records(records: list[dict]) -> list[dict]:
    """The training records (an evaluation record follows the last one)."""
    return [r for r in records if "loss" in r]


def test_fp16_skips_overflowing_steps_counts_them_and_does_not_schedule_them(tmp_path):
    # A huge initial loss scale overflows the first steps; the scaler halves it after each one. (1e30 needed
    # about 90 halvings: all 40 steps of the first version of this test were skipped on an H100.)
    records = launch_on_gpus("gpu", tmp_path, "vae", "max_steps=60", "log_every_steps=60", "mixed_precision=fp16",
                             "fp16_init_scale=1e10", "fp16_growth_interval=1000")  # fmt: skip

    skipped = training_records(records)[-1]["skipped_steps"]
    print(f"fp16: {skipped} of 60 steps skipped")
    assert 1 <= skipped < 60
    assert rank_summary(tmp_path, 0)["optimizer_steps"] == [60 - skipped]


def test_bf16_on_cuda_trains_and_reports_its_speed(tmp_path):
    fp32 = launch_on_gpus("gpu", tmp_path / "fp32", "gpt", *QUICK_GPT, "max_steps=60", "mixed_precision=no")
    bf16 = launch_on_gpus("gpu", tmp_path / "bf16", "gpt", *QUICK_GPT, "max_steps=60", "mixed_precision=bf16")

    speed = training_records(bf16)[-1]["samples_per_s"] / training_records(fp32)[-1]["samples_per_s"]
    print(f"bf16 / fp32 samples per second: {speed:.2f}")
    losses = [r["loss"] for r in training_records(bf16)]
    assert losses[-1] < losses[0]


def test_fsdp_on_cuda_shards_and_trains(tmp_path):
    processes = max(n for n in (1, 2, 4) if n <= torch.cuda.device_count())  # divides the global batch of 32
    records = launch_on_gpus("4gpu_fsdp", tmp_path, "gpt", *QUICK_GPT, "max_steps=30", num_processes=processes)

    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]
    # final/ holds a tied weight under each name: the GPT's LM head is its token embedding, counted once
    total = sum(t.numel() for name, t in final_parameters(tmp_path).items() if name != "lm_head.weight")
    assert rank_summary(tmp_path, 0)["local_elements"] <= total / processes + 0.05 * total


VAE_SAVE_ALL = ["max_steps=30", "log_every_steps=1", "eval_every_steps=0", "save_every_steps=1", "keep_last=0",
                "sample_latent=true"]  # fmt: skip


def checkpoint_tensors(step_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{path.name}/{key}": value for path in sorted(step_dir.glob("*.safetensors"))
            for key, value in load_file(str(path)).items()}  # fmt: skip


def test_bf16_resume_on_cuda_is_bitwise_identical_cuda_rng_included(tmp_path):
    # The VAE samples its latent with torch.randn on the GPU, so a resume that lost the CUDA RNG state diverges.
    full = launch_on_gpus("gpu", tmp_path / "full", "vae", *VAE_SAVE_ALL, "mixed_precision=bf16")
    step_13 = tmp_path / "full" / "checkpoints" / f"step_{13:08d}"
    resumed = launch_on_gpus("gpu", tmp_path / "resumed", "vae", *VAE_SAVE_ALL, "mixed_precision=bf16",
                             f"resume={step_13}")  # fmt: skip

    full_losses = {r["step"]: r["loss"] for r in full if "loss" in r}
    resumed_losses = {r["step"]: r["loss"] for r in resumed if "loss" in r}
    assert sorted(resumed_losses) == list(range(14, 31))
    assert all(resumed_losses[s] == full_losses[s] for s in resumed_losses)
    expected, actual = final_parameters(tmp_path / "full"), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_async_save_from_cuda_writes_exactly_what_a_synchronous_save_writes(tmp_path):
    # Async saves copy GPU tensors into reused pinned host buffers without blocking; the files must not differ.
    common = ["max_steps=20", "log_every_steps=10", "eval_every_steps=0", "save_every_steps=5", "keep_last=0"]
    launch_on_gpus("gpu", tmp_path / "sync", "gpt", *QUICK_GPT, *common, "async_save=false")
    launch_on_gpus("gpu", tmp_path / "async", "gpt", *QUICK_GPT, *common, "async_save=true")

    for step in (5, 10, 15, 20):
        name = f"step_{step:08d}"
        expected = checkpoint_tensors(tmp_path / "sync" / "checkpoints" / name)
        actual = checkpoint_tensors(tmp_path / "async" / "checkpoints" / name)
        assert expected.keys() == actual.keys() and expected
        assert all(torch.equal(actual[key], expected[key]) for key in expected), name


def test_fsdp_on_cuda_with_bf16_resumes_bitwise(tmp_path):
    common = [*QUICK_GPT, "max_steps=20", "save_every_steps=1", "keep_last=0", "log_every_steps=1",
              "mixed_precision=bf16"]  # fmt: skip
    full = launch_on_gpus("4gpu_fsdp", tmp_path / "full", "gpt", *common)
    step_7 = tmp_path / "full" / "checkpoints" / f"step_{7:08d}"
    resumed = launch_on_gpus("4gpu_fsdp", tmp_path / "resumed", "gpt", *common, f"resume={step_7}")

    full_losses = {r["step"]: r["loss"] for r in full if "loss" in r}
    assert [r["loss"] for r in resumed if "loss" in r] == [full_losses[s] for s in range(8, 21)]
    expected, actual = final_parameters(tmp_path / "full"), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_sync_batchnorm_is_accepted_on_cuda_and_trains(tmp_path):
    # One GPU: SyncBatchNorm runs unsynchronised (world of 1), but the conversion, save and export must work.
    records = launch_on_gpus("gpu", tmp_path, "batchnorm", "sync_batchnorm=true", "mixed_precision=no")

    assert [r for r in records if "eval/loss" in r]
    assert any(name.endswith("running_mean") for name in final_parameters(tmp_path))


def test_mfu_is_logged_from_the_device_table_and_is_plausible(tmp_path):
    # A GPT large enough for the matrix units to matter: MFU must be a fraction, from the H100/A100/... table.
    records = launch_on_gpus("gpu", tmp_path, "gpt", "n_layer=4", "d_model=512", "n_head=8", "block_size=256",
                             "global_batch_size=64", "micro_batch_size=32", "max_steps=40", "log_every_steps=20",
                             "eval_every_steps=0", "mixed_precision=bf16")  # fmt: skip

    last = training_records(records)[-1]
    print(
        f"{torch.cuda.get_device_name()}: {last['tflops']:.1f} TFLOP/s, mfu {last.get('mfu')},"
        f" {last['items_per_s']:.0f} tokens/s, {last['mem_allocated_gb']:.2f} GB peak allocated"
    )
    assert 0 < last["mfu"] < 1
    assert last["mem_allocated_gb"] > 0 and last["mem_reserved_gb"] >= last["mem_allocated_gb"]


def test_between_log_steps_the_host_never_waits_for_the_gpu_guard_or_not(tmp_path):
    """Without the guard the host never waits for the GPU between log steps; nor with it (skip_nonfinite_steps, on
    by default): the fused optimizer skips a non-finite step on the device and the verdict is read a step late
    from pinned memory behind an event (stopping/nonfinite.py), which torch's sync debug mode does not count."""
    import warnings

    import accel_trainer as at

    package = str(REPO / "accel_trainer")

    def syncs_by_accel_trainer(steps: int, guard: bool) -> list[str]:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                at.train(
                    "gpt",
                    n_layer=1,
                    d_model=64,
                    block_size=64,
                    max_steps=steps,
                    log_every_steps=0,
                    eval_every_steps=0,
                    mixed_precision="bf16",
                    skip_nonfinite_steps=guard,
                    output_dir=str(tmp_path / f"{steps}_{guard}"),
                    show_progress_bar=False,
                    report=False,
                )
        finally:
            torch.cuda.set_sync_debug_mode(0)
        found = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        print(f"{steps} steps, guard {guard}: {len(found)} synchronisations in all, from {sorted(set(found))}")
        return sorted(f for f in found if f.startswith(package))

    assert syncs_by_accel_trainer(8, guard=False) == syncs_by_accel_trainer(3, guard=False)  # no more for 5 steps
    with_guard = syncs_by_accel_trainer(8, guard=True)
    extra = list(with_guard)
    for sync in syncs_by_accel_trainer(3, guard=True):
        extra.remove(sync)
    assert extra == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism needs 2 CUDA GPUs")
def test_context_parallel_gpt_follows_the_one_gpu_trajectory(tmp_path):
    """8gpu_fsdp_cp.yaml's mechanism on 2 GPUs: each takes half of every sequence, ring attention between them."""
    gpt = [*QUICK_GPT, "max_steps=20", "log_every_steps=1", "mixed_precision=no"]
    one = launch_on_gpus("gpu", tmp_path / "one", "gpt", *gpt)
    (tmp_path / "fsdp_cp.yaml").write_text(TWO_PROCESS_CP_LAYOUT)
    out = tmp_path / "cp"
    run_command(
        [BIN / "accelerate", "launch", "--config_file", tmp_path / "fsdp_cp.yaml", "--main_process_port",
         str(free_port()), WORKERS / "train_and_dump.py", "gpt", f"output_dir={out}", *gpt, *TEST_OVERRIDES],
        env=dump_env(out, 2),
    )  # fmt: skip
    sliced = training_records(read_metrics(out))
    for key in ("loss", "grad_norm"):
        got, want = ([r[key] for r in records] for records in (sliced, training_records(one)))
        print(f"context parallel vs 1 GPU, {key}: max relative difference"
              f" {max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)):.2e}")  # fmt: skip
        assert got == pytest.approx(want, rel=1e-3)
    assert [r["items_seen"] for r in sliced] == [r["items_seen"] for r in training_records(one)]


def test_auto_micro_batch_size_halves_after_a_real_out_of_memory_and_keeps_the_global_batch(tmp_path):
    """A 1M-wide MLP under a 6 GiB cap: 1024 samples of ~16 MB of activations cannot fit in one pass."""
    fraction = 6 * 2**30 / torch.cuda.get_device_properties(0).total_memory
    result = run_command(
        [BIN / "accelerate", "launch", "--config_file", REPO / "accelerate_configs" / "gpu.yaml",
         "--main_process_port", str(free_port()), WORKERS / "train_and_dump.py", "mlp", f"output_dir={tmp_path}",
         "hidden=1048576", "global_batch_size=1024", "micro_batch_size=auto", "max_steps=2", "log_every_steps=1",
         "eval_every_steps=0", *TEST_OVERRIDES],
        env={**dump_env(tmp_path, 1), "ACCEL_TEST_CUDA_MEMORY_FRACTION": str(fraction)},
    )  # fmt: skip

    (line,) = [line for line in result.stdout.splitlines() if line.startswith("micro_batch_size=auto:")]
    print(line)
    chosen = int(line.split(": ")[1].split(" of ")[0])
    assert 1 <= chosen < 1024 and 1024 % chosen == 0
    assert f"= {chosen} per micro-batch x 1 process(es) x {1024 // chosen} accumulation step(s)" in result.stdout
    assert len(training_records(read_metrics(tmp_path))) == 2


def test_compiled_gpt_on_cuda_follows_the_eager_trajectory_and_reports_its_speed(tmp_path):
    # The CPU twin (tests/unit/parallel/test_compiling.py) compiles with inductor's C++ backend; here Triton kernels.
    gpt = [*QUICK_GPT, "max_steps=40", "log_every_steps=10", "mixed_precision=no"]
    eager = training_records(launch_on_gpus("gpu", tmp_path / "eager", "gpt", *gpt))
    compiled = training_records(launch_on_gpus("gpu", tmp_path / "compiled", "gpt", *gpt, "compile=true"))

    print(f"compiled / eager samples per second: {compiled[-1]['samples_per_s'] / eager[-1]['samples_per_s']:.2f},"
          f" {compiled[-1]['compiled_graphs']} graphs")  # fmt: skip
    assert all(r["compiled_graphs"] > 0 for r in compiled)
    # TF32 is off and fp32 kernels differ only in fusion order: the losses agree to fp32 rounding over 40 steps
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-3)
    assert not any("_orig_mod" in name for name in final_parameters(tmp_path / "compiled"))


def test_profiled_steps_on_cuda_leave_a_trace_with_kernels_and_a_memory_snapshot(tmp_path):
    launch_on_gpus("gpu", tmp_path, "vae", "max_steps=4", "profile_steps=2-3", "eval_every_steps=0")

    trace = (tmp_path / "profile" / "profile_0.json").read_text()
    assert '"cat": "kernel"' in trace or '"cat":"kernel"' in trace  # CUDA kernels were recorded, not only CPU ops
    assert (tmp_path / "profile" / "memory_rank0.pickle").stat().st_size > 0


def test_prefetched_batches_pinned_and_copied_on_a_thread_train_bitwise_as_without(tmp_path):
    common = [*QUICK_GPT, "max_steps=12", "log_every_steps=1", "mixed_precision=bf16"]
    plain = launch_on_gpus("gpu", tmp_path / "plain", "gpt", *common)
    prefetched = launch_on_gpus("gpu", tmp_path / "prefetched", "gpt", *common, "num_prefetch_batches=3")

    assert [r["loss"] for r in training_records(prefetched)] == [r["loss"] for r in training_records(plain)]


def test_doctor_passes_on_the_one_gpu_layout_and_places_the_process_on_cuda():
    result = run_command(
        [sys.executable, "-m", "accel_trainer", "doctor", "--config_file", REPO / "accelerate_configs" / "gpu.yaml",
         "--timeout_s", "120"],
        check=False,
    )  # fmt: skip
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CUDA device(s)" in result.stdout
    devices = [line for line in result.stdout.splitlines() if line.startswith(("ok   devices", "FAIL devices"))]
    assert devices and devices[0].startswith("ok   devices") and "cuda" in devices[0]


def test_two_optimizers_stepped_together_under_fp16_follow_the_fp32_run(tmp_path):
    """One gradient scaler for both: each optimizer's gradients unscaled once (accelerate's step unscaled the
    second's twice, 65536 times too small: tests/unit/parallel/test_step.py has the CPU twin)."""
    import accel_trainer as at

    class TwoSgd(at.get_recipe("mlp")):  # type: ignore[misc]
        def build_optimizer(self, cfg, model):
            return {
                "body": torch.optim.SGD(model[0].parameters(), lr=0.1),
                "head": torch.optim.SGD(model[2].parameters(), lr=0.1),
            }

    at.register_recipe("two_sgd_optimizers_on_cuda")(TwoSgd)
    cfg = TwoSgd.Config()
    torch.manual_seed(cfg.seed)  # the framework's initial weights
    initial = {name: value.detach() for name, value in TwoSgd(cfg).build_model(cfg).state_dict().items()}
    moved = {}
    for precision in ("no", "fp16"):
        at.train(
            "two_sgd_optimizers_on_cuda",
            mixed_precision=precision,
            max_steps=10,
            eval_every_steps=0,
            lr_schedule="constant",
            output_dir=str(tmp_path / precision),
            show_progress_bar=False,
            report=False,
            **({"fp16_init_scale": 1024.0} if precision == "fp16" else {}),  # no overflow in the first steps
        )
        reset_accelerate_state()
        final = final_parameters(tmp_path / precision)
        moved[precision] = {name: (final[name] - initial[name]).norm().item() for name in ("0.weight", "2.weight")}
    print(f"distance moved from the initial weights, fp32 vs fp16: {moved}")
    for name in ("0.weight", "2.weight"):
        assert moved["fp16"][name] == pytest.approx(moved["no"][name], rel=0.05), name


def test_a_lora_finetune_on_cuda_in_bf16_checkpoints_the_adapter_alone_and_resumes_bitwise(tmp_path):
    # The fine-tuning path (issue 24) on the GPU: frozen base weights fingerprinted on CUDA, the adapter and its
    # fused AdamW state saved, a resume that fills the base from the run's model and follows the same trajectory.
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    launch_on_gpus("gpu", tmp_path / "base", "hf_causal_lm", "n_layer=2", "n_head=2", "d_model=64",
                   "block_size=128", "max_source_bytes=200000", "max_steps=4", "eval_every_steps=0")  # fmt: skip
    tune = [f"base={tmp_path / 'base' / 'final'}", "lora_r=4", "max_steps=6", "block_size=32",
            "max_source_bytes=200000", "global_batch_size=16", "micro_batch_size=4", "log_every_steps=1",
            "eval_every_steps=0", "save_every_steps=3", "mixed_precision=bf16"]  # fmt: skip
    full = launch_on_gpus("gpu", tmp_path / "full", "hf_finetune", *tune)
    step_3 = tmp_path / "full" / "checkpoints" / "step_00000003"
    resumed = launch_on_gpus("gpu", tmp_path / "resumed", "hf_finetune", *tune, f"resume={step_3}")

    assert all(".lora_A." in name or ".lora_B." in name for name in load_file(str(step_3 / "model.safetensors")))
    assert [r["loss"] for r in training_records(resumed)] == [r["loss"] for r in training_records(full)][3:]
    expected, actual = final_parameters(tmp_path / "full"), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final").num_parameters() > 0


def test_the_estimate_of_the_gpu_layout_is_within_a_fifth_of_what_cuda_allocates(tmp_path):
    """`accel-trainer estimate` plans on the CPU with fake tensors; on the GPU the same two steps (the estimate's own
    preparation, tests/workers/estimate_truth.py) peak at torch.cuda.max_memory_allocated. bf16 (gpu.yaml)."""
    import json

    model = ["n_layer=4", "d_model=512", "block_size=256", "pad_to_block_size=true", "micro_batch_size=8",
             "global_batch_size=8"]  # fmt: skip
    run_command(
        [BIN / "accelerate", "launch", "--config_file", REPO / "accelerate_configs" / "gpu.yaml",
         "--main_process_port", str(free_port()), WORKERS / "estimate_truth.py", "gpt", tmp_path, *model],
    )  # fmt: skip
    real = json.loads((tmp_path / "rank0.json").read_text())
    planned = json.loads(
        run_command([BIN / "accel-trainer", "estimate", "gpt", "layout=gpu", *model, "--json"]).stdout
    )["per_rank"][0]
    print(f"estimate {planned}; on the GPU {real}")  # the note records both
    for kind in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert planned[kind] == real[kind], kind
    assert abs(planned["peak_bytes"] - real["cuda_max_allocated_bytes"]) <= 0.2 * real["cuda_max_allocated_bytes"]


def test_packed_gpt_attention_with_flex_on_cuda_matches_the_dense_mask_of_the_cpu_twin():
    """recipes/gpt.py's document_attention: flex_attention with a block mask on CUDA, SDPA with the dense mask
    elsewhere; outputs and gradients agree."""
    sys.path.insert(0, str(REPO / "recipes"))
    import gpt

    torch.manual_seed(0)
    documents = torch.tensor([[0] * 40 + [1] * 60 + [2] * 28, [0] * 100 + [1] * 28], device="cuda")
    q, k, v = (torch.randn(2, 4, 128, 32, device="cuda", requires_grad=True) for _ in range(3))
    flex = gpt.document_attention(q, k, v, documents, dropout=0.0)
    flex_grads = torch.autograd.grad(flex.square().sum(), (q, k, v))
    dense = gpt.document_attention(*(t.cpu() for t in (q, k, v)), documents.cpu(), dropout=0.0)
    dense_grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
    torch.testing.assert_close(flex.cpu(), dense, rtol=1e-4, atol=1e-4)
    for got, expected in zip(flex_grads, dense_grads, strict=True):
        torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="fp8 needs compute 8.9+"
)
def test_fp8_on_cuda_trains_through_torchaos_float8_linear_layers_as_bf16_does(tmp_path):
    pytest.importorskip("torchao")
    wide = ["n_layer=2", "d_model=256", "block_size=128", "log_every_steps=10", "eval_every_steps=0",
            "global_batch_size=32", "micro_batch_size=16", "max_steps=60"]  # fmt: skip
    bf16 = training_records(launch_on_gpus("gpu", tmp_path / "bf16", "gpt", *wide, "mixed_precision=bf16"))
    fp8 = training_records(launch_on_gpus("gpu", tmp_path / "fp8", "gpt", *wide, "mixed_precision=fp8"))
    speed = fp8[-1]["samples_per_s"] / bf16[-1]["samples_per_s"]
    print(f"fp8 / bf16 samples per second: {speed:.2f}; last loss {fp8[-1]['loss']:.4f} vs {bf16[-1]['loss']:.4f}")
    assert fp8[-1]["loss"] < fp8[0]["loss"] and abs(fp8[-1]["loss"] - bf16[-1]["loss"]) < 0.05 * bf16[-1]["loss"]


def test_qlora_on_cuda_in_bf16_checkpoints_the_adapter_alone_and_resumes_bitwise(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    launch_on_gpus("gpu", tmp_path / "base", "hf_causal_lm", "n_layer=2", "n_head=2", "d_model=64",
                   "block_size=128", "max_source_bytes=200000", "max_steps=4", "eval_every_steps=0")  # fmt: skip
    tune = [f"base={tmp_path / 'base' / 'final'}", "lora_r=4", "quantize_base=nf4", "max_steps=6", "block_size=32",
            "max_source_bytes=200000", "global_batch_size=16", "micro_batch_size=4", "log_every_steps=1",
            "eval_every_steps=0", "save_every_steps=3", "mixed_precision=bf16"]  # fmt: skip
    full = launch_on_gpus("gpu", tmp_path / "full", "hf_finetune", *tune)
    resumed = launch_on_gpus("gpu", tmp_path / "resumed", "hf_finetune", *tune,
                             f"resume={tmp_path / 'full' / 'checkpoints' / 'step_00000003'}")  # fmt: skip
    assert [r["loss"] for r in training_records(resumed)] == [r["loss"] for r in training_records(full)][3:]
    assert rank_summary(tmp_path / "full", 0)["four_bit_bytes"]  # the base stayed in 4 bits on the GPU
