"""The grpo recipe against TRL's GRPOTrainer on the same work: step time and peak resident memory (issue 50).

    python benchmarks/grpo_vs_trl.py                # TRL, then ours
    python benchmarks/grpo_vs_trl.py --only ours    # one side

The work: SmolLM2-135M-Instruct (the GGUF `make install` ships, as the float32 folder sft_vs_trl.py saves), LoRA
r=8 on every linear layer but the head, the demo's arithmetic prompts (accel_trainer/data/arithmetic.py) with its
`short` reward, 4 prompts a step with 8 completions each (one prompt's group a micro-batch, 4 accumulated: TRL's
per_device_train_batch_size=8 and gradient_accumulation_steps=4), completions of at most 16 tokens sampled at
temperature 1, lr 2e-5, 6 steps, TRL 1.16's defaults for everything else (its loss `dapo`, beta 0, no vLLM).
Each trainer runs in a fresh process with 2 threads; printed: the median step time of steps 2 to 6 (sampling
included), the whole process's peak resident memory, and the mean reward of the first steps (both sample their
own completions: the rewards differ, the work is the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpo_vs_trl import save_base, step_timer  # noqa: E402 - the same float32 folder of the shipped GGUF
from sft_vs_trl import peak_rss_mib  # noqa: E402

STEPS, THREADS, PROMPTS, GENERATIONS, LENGTH, LR = 6, 2, 4, 8, 16, 2e-5


def run_trl(base: Path) -> dict[str, object]:
    import datasets
    import peft
    import trl

    from accel_trainer.data import arithmetic

    rows = datasets.Dataset.from_list(arithmetic.prompts(200, 0))
    times: list[float] = []

    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=GENERATIONS, gradient_accumulation_steps=PROMPTS,
        num_generations=GENERATIONS, max_completion_length=LENGTH, learning_rate=LR, max_steps=STEPS, use_cpu=True,
        report_to=[], logging_steps=1, save_strategy="no", seed=0, bf16=False,
    )  # fmt: skip
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(model=str(base), reward_funcs=[arithmetic.short], args=args, train_dataset=rows,
                              peft_config=lora, callbacks=[step_timer(times)])  # fmt: skip
    trainer.train()
    rewards = [record["reward"] for record in trainer.state.log_history if "reward" in record]
    return {"times": times, "rewards": rewards}


def run_ours(base: Path) -> dict[str, object]:
    import accel_trainer as at

    out = Path(tempfile.mkdtemp())
    at.train(
        "grpo", base=str(base), rewards="accel_trainer.data.arithmetic:short", demo_prompts=200, lora_r=8,
        global_batch_size=PROMPTS, micro_batch_size=1, num_generations=GENERATIONS, max_completion_length=LENGTH,
        lr=LR, max_steps=STEPS, save_every_steps=0, held_out=0, output_dir=str(out), show_progress_bar=False,
        report=False,
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [record for record in records if "loss" in record]
    return {"times": [record["step_time_s"] for record in records], "rewards": [record["reward"] for record in records]}


def child(trainer: str, base: Path) -> None:
    import torch

    torch.set_num_threads(THREADS)
    figures = (run_trl if trainer == "trl" else run_ours)(base)
    figures["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(figures))


def measure(trainer: str, folder: Path) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    from accel_trainer.host.allocator import preload_environment

    env = preload_environment(env) or env  # both on the allocator the `accel-trainer` command runs on
    done = subprocess.run([sys.executable, __file__, "--child", trainer, str(folder)], env=env, capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode:
        sys.exit(f"{trainer} failed:\n{done.stderr[-3000:]}")
    figures: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["trl", "ours"], help="run one side only")
    arguments = parser.parse_args()
    if arguments.child:
        child(arguments.child[0], Path(arguments.child[1]) / "base")
        return
    folder = Path(tempfile.gettempdir()) / "accel_trainer_sft_vs_trl"
    if not (folder / "base" / "config.json").is_file():
        save_base(folder / "base")
    results = {}
    for name in [arguments.only] if arguments.only else ["trl", "ours"]:
        results[name] = measure(name, folder)
        times = results[name]["times"]
        assert isinstance(times, list)
        rewards = [round(x, 3) for x in results[name]["rewards"][:4]]  # type: ignore[index]
        peak = results[name]["peak_rss_mib"]
        print(f"{name:5} median step {statistics.median(times[1:]):.2f} s  peak RSS {peak:,.0f} MiB  rewards {rewards}")
    if len(results) == 2:
        ratio = statistics.median(results["trl"]["times"][1:]) / statistics.median(results["ours"]["times"][1:])  # type: ignore[index]
        memory = results["ours"]["peak_rss_mib"] / results["trl"]["peak_rss_mib"]  # type: ignore[operator]
        print(f"TRL / ours step time {ratio:.2f}x; ours / TRL peak RSS {memory:.2f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
