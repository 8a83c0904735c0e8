"""Where a fine-tune's memory goes, by torch's own memory profiler: what is live at the peak, by category (issue 49).

    python benchmarks/memory_breakdown.py sft_chat                 # LoRA r=8 on SmolLM2-135M-Instruct, 3 steps
    python benchmarks/memory_breakdown.py dpo lora_r=0             # any recipe of sft_chat, hf_finetune, dpo; overrides
    python benchmarks/memory_breakdown.py sft_chat chunked_loss=false   # the full logits, for the before figure
    python benchmarks/memory_breakdown.py sft_chat --glibc-heap     # glibc's own mmap threshold (engine/heap.py)

The work is `benchmarks/sft_vs_trl.py`'s (the same base folder and conversations; dpo gets pairs made of them, the
completion chosen and its first half rejected), 3 optimizer steps in one CPU process under
`torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`. torch's `MemoryProfile` sorts
every tensor the steps allocate into parameter, optimizer state, input, activation, gradient, temporary and
autograd detail; printed: the live bytes of each at the peak of the CPU tensors, and the process's peak resident
memory (`ru_maxrss`) over the same steps run first without the profiler, whose excess over the tensors is torch
and the libraries' own memory and the allocator's slack (blocks of 1 MiB and more given back when freed, as a run
does, unless `--glibc-heap`). Tensors made before the first profiled step (the weights, the data) count as they
were when it began.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, Category, TensorKey

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sft_vs_trl  # noqa: E402 - the same base and conversations

STEPS = 3


def pairs(folder: Path) -> Path:
    """Preference pairs from the benchmark's conversations: the completion chosen, its first half rejected."""
    path = folder / "pairs.jsonl"
    if not path.is_file():
        rows = [json.loads(line) for line in (folder / "chats.jsonl").read_text().splitlines()]
        lines = []
        for row in rows:
            answer = row["completion"][0]["content"]
            half = " ".join(answer.split()[: max(1, len(answer.split()) // 2)])
            rejected = [{"role": "assistant", "content": half}]
            lines.append(json.dumps({"prompt": row["prompt"], "chosen": row["completion"], "rejected": rejected}))
        path.write_text("\n".join(lines) + "\n")
    return path


def parts(recipe_name: str, folder: Path, overrides: dict[str, str]) -> tuple[Any, torch.nn.Module, list[Any]]:
    """The recipe, its model (the adapter on the base, as a run builds it) and two micro-batches of 8 of its data."""
    import accel_trainer as at
    from accel_trainer.config.fields import check_values

    data = pairs(folder) if recipe_name == "dpo" else folder / "chats.jsonl"
    if recipe_name == "hf_finetune":
        data = folder / "text.txt"
        if not data.is_file():
            rows = [json.loads(line) for line in (folder / "chats.jsonl").read_text().splitlines()]
            data.write_text("\n\n".join(row["completion"][0]["content"] for row in rows) + "\n")
    settings: dict[str, Any] = {"block_size": sft_vs_trl.WINDOW} if recipe_name != "dpo" else {}
    if recipe_name == "hf_finetune":
        settings["pack_sequences"] = True  # the answers' paragraphs packed into full windows, as sft_chat's
    recipe_class = at.get_recipe(recipe_name)
    (typed,) = check_values((recipe_class.Config,), overrides, "for the benchmark")  # as the command line types them
    cfg = recipe_class.Config(base=str(folder / "base"), data=str(data), micro_batch_size=8, **settings, **typed)
    recipe = recipe_class(cfg)
    recipe.tokenizer = recipe.build_tokenizer(cfg)
    model = recipe.build_model(cfg)
    train, _ = recipe.build_datasets(cfg)
    batches = [recipe.collate([train[i] for i in range(start, start + 8)]) for start in (0, 8)]
    return recipe, model, batches


def steps(recipe: Any, model: torch.nn.Module, batches: list[Any]) -> None:
    """STEPS optimizer steps of two accumulated micro-batches, AdamW on the trained weights, as the loop takes them."""
    from accel_trainer.contract.losses import read_loss_output

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(STEPS):
        for batch in batches:
            read_loss_output(recipe.compute_loss(model, batch)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def live_at_peak(prof: profile) -> tuple[int, dict[str, int]]:
    """The peak of the CPU tensors' live bytes, and those bytes by torch's category at that moment."""
    memory = prof._memory_profile()
    categories, cpu = memory._categories, torch.device("cpu")
    live: dict[tuple[TensorKey, int], int] = {}
    total, peak, at_peak = 0, 0, {}
    for _, action, (key, version), size in memory.timeline:
        if key.device != cpu:
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            live[(key, version)] = size
            total += size
        elif action == Action.INCREMENT_VERSION:
            live[(key, version + 1)] = live.pop((key, version), size)
        elif action == Action.DESTROY:
            total -= live.pop((key, version), 0)
        if total > peak:
            peak, at_peak = total, dict(live)
    by_category: dict[str, int] = {}
    for (key, version), size in at_peak.items():
        category = categories.get(key, version)
        name = category.name.lower() if isinstance(category, Category) else "unknown"
        by_category[name] = by_category.get(name, 0) + size
    return peak, by_category


def main() -> None:
    from accel_trainer.engine.heap import large_blocks_returned

    arguments = sys.argv[1:] or ["sft_chat"]
    if "--glibc-heap" not in arguments:
        large_blocks_returned()
    recipe_name, *extra = [argument for argument in arguments if argument != "--glibc-heap"]
    overrides = dict(item.split("=", 1) for item in extra)
    folder = Path(tempfile.gettempdir()) / "accel_trainer_sft_vs_trl"
    if not (folder / "base" / "config.json").is_file():
        sft_vs_trl.save_base(folder / "base")
    if not (folder / "chats.jsonl").is_file():
        (folder / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_vs_trl.conversations()))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    recipe, model, batches = parts(recipe_name, folder, overrides)
    held = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    steps(recipe, model, batches)  # unprofiled first: the profiler's own records would swell the resident figure
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        steps(recipe, model, batches)
    peak, by_category = live_at_peak(prof)
    print(
        f"{recipe_name} {' '.join(extra)}: peak of live CPU tensors {peak / 2**20:,.0f} MiB; process peak RSS"
        f" {rss:,.0f} MiB over {STEPS} unprofiled steps ({held:,.0f} MiB resident before them)"
    )
    for name, size in sorted(by_category.items(), key=lambda item: -item[1]):
        print(f"  {name:16} {size / 2**20:9,.1f} MiB")


if __name__ == "__main__":
    main()
