"""Packed batches into a transformers Llama: the positions alone (padding-free) against a dense 4-D mask.

    OMP_NUM_THREADS=1 python benchmarks/packed_attention.py

hf_causal_lm's `model_inputs` gives a model built on transformers' masking utilities each token's position in its
own sequence and nothing else (`use_cache=False`), so the model finds the packed sequences itself; it used to build
a (batch, 1, L, L) boolean mask of its own. Each configuration trains in a fresh process (one thread): a Llama of
4 layers (width 256, 8 heads, 2 key-value heads, a 4,096-token vocabulary), 8 windows of L + 1 tokens, each
holding sequences of 16 to L/2 tokens back to back, forward, backward and an AdamW step. Printed: the median step
of 10 after 3 of warm-up, the peak resident memory above what the process held before its first step, and the
loss of the first step, the same in both forms (the two keep the same sequences apart).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LENGTHS = (128, 1024)
FORMS = ("bool mask", "positions alone")  # hf_causal_lm.Packing forms: a 4-D mask, or the positions alone


def packed_windows(length: int, rows: int = 8, seed: int = 0) -> list[dict[str, list[int]]]:
    """Windows of length + 1 tokens holding whole sequences of 16 to length / 2 tokens, the last one cut."""
    generator = torch.Generator().manual_seed(seed)
    windows = []
    for _ in range(rows):
        ids, documents, number = [], [], 0
        while len(ids) < length + 1:
            size = int(torch.randint(16, length // 2 + 1, (1,), generator=generator))
            ids += torch.randint(3, 4096, (size,), generator=generator).tolist()
            documents += [number] * size
            number += 1
        windows.append({"input_ids": ids[: length + 1], "documents": documents[: length + 1]})
    return windows


def one_configuration(length: int, form: str) -> dict[str, float]:
    """Train the configuration in this process; its step time, peak memory and first loss."""
    import transformers

    sys.path.insert(0, str(REPO / "recipes"))
    import gpt
    import hf_causal_lm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=length,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    assert hf_causal_lm.packs_by_positions(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = gpt.collate_packed(packed_windows(length))
    inputs = hf_causal_lm.model_inputs(batch, hf_causal_lm.Packing(form))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for _ in range(13):
        started = time.perf_counter()
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"step_ms": 1000 * statistics.median(times[3:]), "peak_mb": (peak - before) / 1024, "loss": losses[0]}


def main() -> None:
    print(f"{'L':>5} {'form':>16} {'step (ms)':>10} {'peak above start (MB)':>22} {'first loss':>11}")
    results = {}
    for length in LENGTHS:
        for form in FORMS:
            code = f"import json, packed_attention as p; print(json.dumps(p.one_configuration({length}, {form!r})))"
            output = subprocess.run(
                [sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
            ).stdout
            result = results[length, form] = json.loads(output.strip().splitlines()[-1])
            figures = f"{result['step_ms']:>10.1f} {result['peak_mb']:>22.1f} {result['loss']:>11.6f}"
            print(f"{length:>5} {form:>16} {figures}")
    for length in LENGTHS:
        dense, free = results[length, FORMS[0]], results[length, FORMS[1]]
        print(
            f"L={length}: positions alone take {free['step_ms'] / dense['step_ms']:.2f}x the 4-D mask's step time and"
            f" {free['peak_mb'] - dense['peak_mb']:+.1f} MB of its peak"
        )


if __name__ == "__main__":
    main()
