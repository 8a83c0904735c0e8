"""`accel-trainer sample RUN --prompt "..."`: what a trained causal language model writes after a prompt.

    accel-trainer sample outputs/hf_causal_lm/run1 --prompt "def " --prompt "import "
    accel-trainer sample outputs/hf_finetune/run2 --prompt "class " --max_new_tokens 80 --temperature 0
    accel-trainer sample outputs/sft_chat/run3 --chat --prompt "What does json.dumps do?"

The run's `final/` is read as transformers reads any model folder: `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` (the recipe's tokenizer, which final/ holds: checkpoint/tokenizer.py), and each
prompt is continued with the model's own `generate`: sampled with a fixed seed (the same command prints the same
text), or greedy with `--temperature 0`. One process, on the CPU or the first GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from accel_trainer.contract.pretrained import quiet_progress_bars
from accel_trainer.errors import UserError


def sample(
    run: str | Path,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    seed: int = 0,
    chat: bool = False,
) -> list[str]:
    """Each prompt followed by what the run's final model writes after it; with `chat`, each prompt is a user's
    message put through the tokenizer's chat template (a chat recipe's, saved in final/) and the result is the
    assistant's reply alone, up to the end-of-text token.

    Raises:
        UserError: the run has no final/ model folder or tokenizer (or chat template, with `chat`), or
            transformers is not installed.
    """
    final = _final_folder(Path(run))
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise UserError("accel-trainer sample needs transformers: pip install 'accel-trainer[hf]'") from None
    if not (final / "config.json").is_file():
        raise UserError(f"{final} holds no transformers model (no config.json): sample reads a causal LM's final/")
    if not any((final / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(
            f"{final} holds no tokenizer: its recipe builds none (a recipe's build_tokenizer is saved in final/)"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quiet_progress_bars()
    model: Any = AutoModelForCausalLM.from_pretrained(final)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{final}'s tokenizer has no chat template: sample it without --chat")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    texts = []
    for prompt in prompts:
        torch.manual_seed(seed)
        text = prompt
        if chat:
            message = [{"role": "user", "content": prompt}]
            text = str(tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True))
        encoded = tokenizer(text, return_tensors="pt", add_special_tokens=not chat).to(device)  # a template has its own
        options = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            output = model.generate(**encoded, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **options)
        new_tokens = output[0, encoded["input_ids"].shape[1] :] if chat else output[0]
        texts.append(str(tokenizer.decode(new_tokens, skip_special_tokens=True)))
    return texts


def _final_folder(run: Path) -> Path:
    """`run`'s final/ (or `run` itself, a final/ or export folder)."""
    if (run / "config.json").is_file():
        return run
    if (run / "final").is_dir():
        return run / "final"
    if not run.exists():
        raise UserError(f"{run} does not exist; name a run folder")
    raise UserError(f"run folder {run} has no final/ yet: sample reads a finished run's final weights")
