"""The sft_chat recipe against TRL's SFTTrainer on the same work: peak resident memory and step time (issue 49).

    python benchmarks/sft_vs_trl.py                 # TRL, ours, ours in bf16: LoRA r=8, the default run below
    python benchmarks/sft_vs_trl.py --only ours     # one side (its figures as JSON), e.g. while changing it
    python benchmarks/sft_vs_trl.py --ours-args quantize_base=nf4   # extra overrides for accel-trainer's run

The work: SmolLM2-135M-Instruct (the GGUF `make install` ships, dequantized once and saved as a float32
`save_pretrained` folder that both load), LoRA r=8 (alpha 16, no dropout) on every linear layer but the head,
800 conversational prompt/completion rows (sft_chat's questions about the standard library, answered by their
docstrings' first sentences), packed into 128-token windows, the loss on the completion's tokens, 16 windows a
step (8 a micro-batch, 2 accumulated), 14 steps. TRL 1.16 keeps its defaults for everything not named (its
gradient checkpointing and bf16 autocast among them); accel-trainer runs twice, with its own (the `cpu` layout:
float32, activations kept) and at TRL's precision (`ours_bf16`: `mixed_precision=bf16`, the bf16 autocast TRL
runs; this CPU has AVX512-BF16).

Each trainer runs in a fresh process with 2 threads on this 2-core machine. Printed per trainer: the median step
time of steps 3 to 14, the whole process's peak resident memory (`ru_maxrss`, from its start to its end,
loading, training and saving included) and the resident memory before training started; then the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpo_vs_trl import save_base, step_timer  # noqa: E402 - the same float32 folder of the shipped GGUF

STEPS, THREADS, ROWS, WINDOW, MICRO, ACCUMULATION = 14, 2, 800, 128, 8, 2


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def conversations(count: int = ROWS) -> list[dict[str, list[dict[str, str]]]]:
    """Prompt/completion rows in TRL's conversational form, from sft_chat's questions about the stdlib."""
    import accel_trainer as at

    sft_chat = sys.modules[at.get_recipe("sft_chat").__module__]
    questions = sft_chat.stdlib_questions(2_000_000, 160)
    return [{"prompt": [question], "completion": [answer]} for question, answer in questions[:count]]


def run_trl(base: Path, data: Path, extra: list[str]) -> dict[str, object]:
    import datasets
    import peft
    import trl

    rows = datasets.Dataset.from_list([json.loads(line) for line in data.read_text().splitlines()])
    times: list[float] = []
    before: list[float] = []

    args = trl.SFTConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, packing=True, max_length=WINDOW, use_cpu=True, report_to=[], logging_steps=1,
        save_strategy="no", seed=0,
    )  # fmt: skip
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    timer = step_timer(times, at_start=lambda: before.append(current_rss_mib()))
    trainer = trl.SFTTrainer(model=str(base), args=args, train_dataset=rows, peft_config=lora, callbacks=[timer])
    trainer.train()
    losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    return {"times": times, "losses": losses, "rss_before_training_mib": before[0]}


def run_ours(base: Path, data: Path, extra: list[str]) -> dict[str, object]:
    import accel_trainer as at

    out = Path(tempfile.mkdtemp())
    overrides = dict(item.split("=", 1) for item in extra)
    at.train(
        "sft_chat", base=str(base), data=str(data), lora_r=8, lora_alpha=16.0, block_size=WINDOW,
        global_batch_size=MICRO * ACCUMULATION, micro_batch_size=MICRO, max_steps=STEPS, log_every_steps=1,
        eval_every_steps=0, save_every_steps=0, output_dir=str(out), show_progress_bar=False, report=False,
        **overrides,
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [record for record in records if "loss" in record and "step_time_s" in record]
    info = json.loads((out / "run_info.json").read_text())
    return {
        "times": [record["step_time_s"] for record in records],
        "losses": [record["loss"] for record in records],
        "rss_by_step_gib": [record.get("host_rss_gb") for record in records],
        "run_info_memory": info.get("memory"),
    }


def child(trainer: str, base: Path, data: Path, extra: list[str]) -> None:
    import torch

    from accel_trainer.host.allocator import in_use

    torch.set_num_threads(THREADS)
    figures = (run_trl if trainer == "trl" else run_ours)(base, data, extra)
    figures["peak_rss_mib"] = peak_rss_mib()
    figures["allocator"] = in_use()
    print(json.dumps(figures))


def measure(trainer: str, folder: Path, extra: list[str]) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    if trainer == "ours":  # on the allocator the `accel-trainer` command runs on: tcmalloc where installed
        from accel_trainer.host.allocator import preload_environment

        env = preload_environment(env) or env
    command = [sys.executable, __file__, "--child", trainer, str(folder), *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{trainer} failed:\n{done.stderr[-3000:]}")
    figures: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["trl", "ours", "ours_bf16"], help="run one of the three only")
    parser.add_argument("--ours-args", nargs="*", default=[], help="key=value overrides for accel-trainer's run")
    parser.add_argument("--folder", type=Path, help="where the base and data are kept (made once)")
    arguments = parser.parse_args()
    if arguments.child:
        trainer, folder, *extra = arguments.child
        child(trainer, Path(folder) / "base", Path(folder) / "chats.jsonl", extra)
        return
    folder = arguments.folder or Path(tempfile.gettempdir()) / "accel_trainer_sft_vs_trl"
    if not (folder / "base" / "config.json").is_file():
        save_base(folder / "base")
    if not (folder / "chats.jsonl").is_file():
        (folder / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in conversations()))
    runs = {"trl": ("trl", []), "ours": ("ours", arguments.ours_args),
            "ours_bf16": ("ours", [*arguments.ours_args, "mixed_precision=bf16"])}  # fmt: skip
    names = [arguments.only] if arguments.only else list(runs)
    results = {}
    for name in names:
        trainer, extra = runs[name]
        results[name] = measure(trainer, folder, extra)
        times = results[name]["times"]
        assert isinstance(times, list)
        print(
            f"{name:9} median step {statistics.median(times[2:]):.3f} s  peak RSS"
            f" {results[name]['peak_rss_mib']:,.0f} MiB  allocator {results[name]['allocator']}"
            f"  losses {[round(x, 4) for x in results[name]['losses'][:3]]}"
        )
    for name in (name for name in results if name != "trl" and "trl" in results):
        ratio_memory = results[name]["peak_rss_mib"] / results["trl"]["peak_rss_mib"]  # type: ignore[operator]
        ratio_time = statistics.median(results["trl"]["times"][2:]) / statistics.median(results[name]["times"][2:])  # type: ignore[index]
        print(f"{name} / TRL peak RSS {ratio_memory:.2f}x (target <= 0.8x); TRL / {name} step time {ratio_time:.2f}x"
              " (target >= 1.0x)")  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
