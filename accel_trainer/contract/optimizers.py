"""The default optimizer a recipe gets (`optimizer=`), torch's own: AdamW, Adafactor, SGD, or Muon with AdamW.

Weight decay goes to matrices and embeddings, never to biases and norm gains, whichever optimizer. Muon
(torch.optim.Muon) orthogonalizes each update of a 2-D hidden-layer weight, so it takes the weights of linear
layers only; the embeddings, a transformers model's output head, biases, norms and any other tensor go to AdamW
(Muon's authors' split, and torch's documentation's). The two are returned as two optimizers stepped together
(optim/optimizers.py), logged as lr/muon and lr/adamw. Muon's update is scaled to match AdamW's RMS
(`adjust_lr_fn="match_rms_adamw"`, Moonshot's), so one `lr` serves both. It needs each process to hold whole
matrices: a sharded layout (FSDP, tensor parallel) is refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from accel_trainer.errors import ConfigError

MUON_SHARDED = (
    "optimizer=muon orthogonalizes whole matrices, which this layout shards or splits over processes: use a"
    " data-parallel layout (cpu_ddp, 4gpu_ddp, ...) or another optimizer"
)


def built_in_optimizer(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer | dict[str, torch.optim.Optimizer]:
    """`cfg.optimizer` over `model`'s trainable parameters, with `cfg.lr` and `cfg.weight_decay`.

    Raises:
        ConfigError: muon over sharded parameters.
    """
    trained: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    choice = getattr(cfg, "optimizer", "adamw")
    if choice == "muon":
        return _muon_and_adamw(cfg, model, trained)
    groups: Any = _decay_groups(cfg, trained)
    if choice == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr)
    if choice == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in model.parameters())
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=fused or None)


def _is_linear(module: torch.nn.Module) -> bool:
    """A linear layer: torch's, or transformers' `Conv1D` (GPT-2's, its weight transposed: Muon's update of a
    matrix is that of its transpose, transposed)."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def _decay_groups(cfg: Any, parameters: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The parameters in two groups: matrices and embeddings decayed, biases and norm gains not."""
    groups = [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def _muon_and_adamw(cfg: Any, model: torch.nn.Module, trained: list[torch.Tensor]) -> dict[str, torch.optim.Optimizer]:
    """Muon for the linear layers' 2-D weights but the output head's, AdamW (decay groups) for everything else."""
    if any(isinstance(p, DTensor) for p in trained):
        raise ConfigError(MUON_SHARDED)
    kept_out = {
        id(p) for module in model.modules() if isinstance(module, torch.nn.Embedding) for p in module.parameters()
    }
    heads = [getattr(module, "get_output_embeddings", lambda: None)() for module in model.modules()]
    kept_out |= {id(p) for head in heads if isinstance(head, torch.nn.Module) for p in head.parameters()}
    linear = {id(module.weight) for module in model.modules() if _is_linear(module)}
    muon = [p for p in trained if id(p) in linear and id(p) not in kept_out and p.ndim == 2]
    if not muon:
        raise ConfigError(
            f"optimizer=muon: {type(model).__name__} has no trained weight of a linear layer for Muon (embeddings"
            " and the output head stay with AdamW); use adamw"
        )
    chosen = {id(p) for p in muon}
    rest: Any = _decay_groups(cfg, [p for p in trained if id(p) not in chosen])
    optimizers: dict[str, torch.optim.Optimizer] = {}
    optimizers["muon"] = torch.optim.Muon(
        muon, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    if rest:
        optimizers["adamw"] = torch.optim.AdamW(rest, lr=cfg.lr)
    return optimizers
