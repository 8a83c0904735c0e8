"""The `grpo` recipe's demo: sums of two numbers asked in a conversation, and two reward functions for them.

    accel-trainer train grpo base=SmolLM2-135M-Instruct.Q4_1.gguf        # these prompts and rewards
    accel-trainer train grpo base=... data=mine.jsonl rewards=accel_trainer.data.arithmetic:short,mine.py:fn

`correct` scores 1 where the completion's last number is the sum (a model that shows its working ends with the
answer), `short` rewards answers of a few characters: a learnable format reward, which rises first.
"""

from __future__ import annotations

import random
import re
from typing import Any


def prompts(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` rows of a conversational `prompt` asking the sum of two numbers below 50, and its `answer`."""
    generator = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = generator.randrange(50), generator.randrange(50)
        question = f"What is {a} + {b}? Answer with the number only."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": a + b})
    return rows


def correct(prompts: list[Any], completions: list[Any], answer: list[int], **columns: Any) -> list[float]:
    """1 where the completion's last number is the answer, else 0."""
    return [
        1.0 if last_number(text_of(completion)) == wanted else 0.0
        for completion, wanted in zip(completions, answer, strict=True)
    ]


def short(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """1 for an answer of at most 8 characters, falling to 0 at 40."""
    return [max(0.0, min(1.0, (40 - len(text_of(completion).strip())) / 32)) for completion in completions]


def text_of(completion: Any) -> str:
    """A completion's text: itself, or a conversational completion's message."""
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None
