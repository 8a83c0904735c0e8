"""The chunked LM loss against the whole logits: the peak of a 2,048-token step of a 49,152-word vocabulary (issue 49).

    python benchmarks/lm_loss_memory.py

SmolLM2-135M-Instruct's architecture (its config: 30 layers, width 576, 49,152 words, the head tied to the
embedding), random weights, one micro-batch of 16 windows of 128 tokens (2,048), every token a target, forward and
backward, each configuration in a fresh process with 2 threads. Measured with torch's memory profiler: the peak of
the live CPU tensors (weights included) of a second step, and the process's peak resident memory over a first one
run without the profiler. Configurations: the loss from the
whole logits (`chunked_loss=false`'s computation, `at.token_cross_entropy`) or in chunks (`at.lm_loss`); every
weight trained or a LoRA adapter (r=8); the model's activations kept or checkpointed (transformers'
`gradient_checkpointing_enable`, as `activation_checkpointing=true` does).
"""

from __future__ import annotations

import itertools
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

WINDOWS, LENGTH, THREADS = 16, 128, 2


def smollm2_config() -> object:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )  # fmt: skip


def one_step(chunked: bool, adapter: bool, checkpointed: bool) -> dict[str, float]:
    import peft
    import transformers
    from memory_breakdown import live_at_peak
    from torch.profiler import ProfilerActivity, profile

    import accel_trainer as at
    from accel_trainer.engine.heap import large_blocks_returned

    large_blocks_returned()  # as a run does (accel_trainer/engine/heap.py)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(smollm2_config())
    if adapter:
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = at.with_chunked_loss(model).train()
    ids = torch.randint(0, 49152, (WINDOWS, LENGTH + 1))
    inputs, targets = {"input_ids": ids[:, :-1], "use_cache": False}, ids[:, 1:]

    def step() -> None:
        out = at.lm_loss(model, inputs, targets) if chunked else at.token_cross_entropy(model(**inputs).logits, targets)
        out["loss"].backward()
        model.zero_grad(set_to_none=True)

    step()  # unprofiled first: the profiler's own records would swell the resident figure
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    peak, _ = live_at_peak(prof)
    return {"tensors_mib": peak / 2**20, "rss_mib": rss}


def main() -> None:
    if len(sys.argv) == 4:  # a child: one configuration
        torch.set_num_threads(THREADS)
        print(json.dumps(one_step(*(flag == "1" for flag in sys.argv[1:]))))
        return
    print(f"SmolLM2-135M's shape, {WINDOWS} x {LENGTH} tokens, 49,152 words; peak of live tensors / peak RSS")
    for adapter, checkpointed in itertools.product((True, False), (False, True)):
        figures = {}
        for chunked in (False, True):
            flags = [str(int(flag)) for flag in (chunked, adapter, checkpointed)]
            done = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True, check=True)
            figures[chunked] = json.loads(done.stdout.strip().splitlines()[-1])
        cut = 1 - figures[True]["tensors_mib"] / figures[False]["tensors_mib"]
        print(f"{'LoRA r=8' if adapter else 'full    '} {'checkpointed' if checkpointed else 'kept        '}"
              f"  whole logits {figures[False]['tensors_mib']:7,.0f} / {figures[False]['rss_mib']:7,.0f} MiB"
              f"  chunked {figures[True]['tensors_mib']:7,.0f} / {figures[True]['rss_mib']:7,.0f} MiB"
              f"  tensors' peak cut by {cut:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
