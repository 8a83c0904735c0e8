"""The recipe's tokenizer travels with the model: written into final/, fingerprinted in every checkpoint.

A model's token ids mean nothing without the tokenizer that made them: `final/` holds it
(`AutoTokenizer.from_pretrained(<run>/final)` loads it beside the model), and a resume whose recipe now builds
another tokenizer (another vocabulary, merges, special tokens or chat template) is refused in one line instead
of training on ids that mean other text. The fingerprint is a SHA-256 of what defines the tokenization, not of
the saved files: `save_pretrained` writes a `tokenizer_config.json` that differs after a reload and save.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from accel_trainer.checkpoint.files import CheckpointError

RECORD_KEY = "tokenizer"  # train_state.json's entry
_RUNTIME_SETTINGS = ("truncation", "padding")  # a fast tokenizer's call settings, not its tokenization


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """A SHA-256 of the tokenizer's vocabulary, special tokens, chat template and (a fast tokenizer) its whole
    pipeline; None without a tokenizer."""
    if tokenizer is None:
        return None
    parts: dict[str, Any] = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": getattr(tokenizer, "special_tokens_map", {}),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pipeline = json.loads(backend.to_str())
        parts["pipeline"] = {key: value for key, value in pipeline.items() if key not in _RUNTIME_SETTINGS}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def check_tokenizer(folder: Path, recorded: dict[str, Any], fingerprint: str | None) -> None:
    """Refuse a checkpoint trained with another tokenizer than the one this run's recipe builds.

    Raises:
        CheckpointError: both runs have a tokenizer and they tokenize differently.
    """
    saved = recorded.get(RECORD_KEY)
    if saved is not None and fingerprint is not None and saved != fingerprint:
        raise CheckpointError(
            f"checkpoint {folder} was trained with another tokenizer (sha256 {saved[:12]}) than the one this run's"
            f" recipe builds ({fingerprint[:12]}): its token ids would mean other text; build the tokenizer it was"
            " trained with, or start a new run"
        )


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Write the tokenizer beside the model, as `AutoTokenizer.from_pretrained(folder)` reads it."""
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
