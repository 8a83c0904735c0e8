"""A reference model's log-probabilities of every pair, computed once before training (`precompute_ref=true`) and
cached beside the tokenized data, so that training runs no reference forward and holds no reference copy (TRL's
`precompute_ref_log_probs`).

The cache is one safetensors file in the datasets cache (`$HF_DATASETS_CACHE/accel_trainer_reference_logps/`),
named by a key: a SHA-256 of the reference's weights, the pairs' tokens and the batching that cuts them. Another
base, other pairs or another max_length make another key, so a stale file is never read; the recipe records the key
in its `data_fingerprints`, so a resume that would read other values is refused in one line
(data/run_data.py). The main process computes and writes the file (atomically); the others, which build their
sets after it, read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import PartialState
from safetensors.torch import load_file, save_file

from accel_trainer.contract.lm_loss import lm_token_losses, with_chunked_loss
from accel_trainer.contract.preference import completion_targets, sequence_logps
from accel_trainer.contract.pretrained import weights_digest
from accel_trainer.data.preference_pairs import REFERENCE_COLUMNS, sequences

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def with_reference_logps(
    splits: dict[str, datasets.Dataset],
    reference: torch.nn.Module,
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    batch_size: int,
    batching: str,
) -> tuple[dict[str, datasets.Dataset], str]:
    """The tokenized pairs of each split with `ref_chosen_logps` and `ref_rejected_logps` columns, and the cache's
    key. `reference` is the reference model (on the CPU, as loaded); `collate` makes the batches training makes
    (`batching` says how, for the key); `batch_size` pairs go through the reference at once."""
    key = cache_key(splits, reference, batching)
    path = cache_folder() / f"{key}.safetensors"
    count, main = sum(len(pairs) for pairs in splits.values()), PartialState().is_main_process
    if path.exists():
        values, said = load_file(str(path)), f"read from {path}"
    else:
        started, values = time.perf_counter(), {}
        for name, pairs in splits.items():
            chosen, rejected = reference_logps(pairs, reference, collate, batch_size)
            values[f"{name}/chosen"], values[f"{name}/rejected"] = chosen, rejected
        said = f"computed in {time.perf_counter() - started:.1f} s, cached in {path}"
        if main:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            save_file(values, str(temporary), metadata={"pairs": json.dumps({n: len(s) for n, s in splits.items()})})
            os.replace(temporary, path)
    if main:
        print(f"accel-trainer: the reference's log-probabilities of {count} pairs {said}", flush=True)
    with_columns = {}
    for name, pairs in splits.items():
        for column, side in zip(REFERENCE_COLUMNS, ("chosen", "rejected"), strict=True):
            pairs = pairs.add_column(column, values[f"{name}/{side}"].tolist())
        with_columns[name] = pairs
    return with_columns, key


def reference_logps(
    pairs: datasets.Dataset, reference: torch.nn.Module, collate: Callable[..., Any], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's completion log-probabilities of each pair, chosen and rejected, in eval mode without
    gradients, on this process's device; the head's loss in chunks (at.lm_loss), never the whole logits."""
    device = PartialState().device
    reference = with_chunked_loss(reference.to(device).eval())
    chosen, rejected = [], []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            rows = pairs.select(range(start, min(start + batch_size, len(pairs))))
            batch = sequences(collate([{c: row[c] for c in TOKEN_COLUMNS} for row in rows]))
            batch = {k: v.to(device) for k, v in batch.items()}
            targets = completion_targets(batch["input_ids"], batch["completion_mask"])
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            logps = sequence_logps(lm_token_losses(reference, inputs, targets), targets).cpu()
            chosen.append(logps[: len(rows)])
            rejected.append(logps[len(rows) :])
    return torch.cat(chosen), torch.cat(rejected)


def cache_key(splits: dict[str, datasets.Dataset], reference: torch.nn.Module, batching: str) -> str:
    """The SHA-256 of the reference's weights, each split's pair tokens and the batching."""
    digest = hashlib.sha256(weights_digest(dict(reference.state_dict())).encode())
    digest.update(batching.encode())
    for name, pairs in sorted(splits.items()):
        digest.update(name.encode())
        for column in TOKEN_COLUMNS:
            digest.update(json.dumps(list(pairs[column])).encode())
    return digest.hexdigest()


def cache_folder() -> Path:
    return Path(datasets.config.HF_DATASETS_CACHE) / "accel_trainer_reference_logps"
