"""Where a model's pretrained weights came from: the one place that reads transformers' and peft's records of it
(checkpoints fingerprint the base, FSDP's RAM-efficient loading reads a base on the main process only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def base_source(model: torch.nn.Module) -> str | None:
    """The folder or hub name a transformers or peft model was loaded from, or None."""
    adapters = getattr(model, "peft_config", None)
    adapters = adapters if isinstance(adapters, dict) else {}  # a peft model's, by adapter name
    names = [getattr(adapter, "base_model_name_or_path", None) for adapter in adapters.values()]
    name = next(filter(None, names), None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return None
    return str(Path(name).resolve()) if Path(name).is_dir() else str(name)


def quiet_progress_bars() -> None:
    """transformers' and huggingface_hub's progress bars off in this process ("Loading weights" at every build,
    "Writing model shards" at every save: three or four bars a run between the framework's own lines). The
    environment variable covers a later import of transformers; `HF_HUB_DISABLE_PROGRESS_BARS=0` keeps them."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "0":
        sys.modules["transformers"].utils.logging.disable_progress_bar()
