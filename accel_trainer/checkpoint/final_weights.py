"""The run's final weights: `final/model.safetensors` (or a transformers folder) and the recipe's artifacts.

The file is a plain state dict with every name of the model's own: a tied weight (an LM head and its token
embedding) is stored under each of its names, as in checkpoints. safetensors cannot alias two names to one
tensor, and both `save_model` and transformers' `save_pretrained` keep only one name, so
`model.load_state_dict(load_file("final/model.safetensors"))` on a freshly built model failed on the other
(strict). The price is one more copy of each tied tensor on disk; `from_pretrained` loads the file and ties
the weights again. (safetensors' `load_model` refuses the second name as unexpected: load with
`load_state_dict`.)
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from accel_trainer.checkpoint import files, state_files
from accel_trainer.checkpoint.tokenizer import save_tokenizer
from accel_trainer.config.train_config import TrainConfig, config_to_yaml
from accel_trainer.contract.pretrained import base_source
from accel_trainer.contract.quantization import dequantize
from accel_trainer.contract.reference import policy_of
from accel_trainer.parallel.batchnorm import average_running_stats
from accel_trainer.parallel.sharding import is_sharded, pipeline_size
from accel_trainer.recipe import Recipe


def save_final(
    accelerator: Accelerator,
    recipe: Recipe,
    cfg: TrainConfig,
    model: torch.nn.Module,
    eval_set: Any,
    run_dir: Path,
    ema: bool = False,
) -> None:
    """Write `final/model.safetensors` (consolidated, unwrapped weights) and the recipe's artifacts; with `ema`
    (the model holding its EMA weights), `final/ema/model.safetensors` alone.

    A transformers model is written with its own `save_pretrained` (model.safetensors and config.json), so
    `from_pretrained(run_dir / "final")` loads it.

    The weights are loaded into a freshly built CPU model, which works the same whether the trained model is
    plain, DDP-wrapped or sharded; its state dict is written with every name, tied ones as copies.
    """
    average_running_stats(accelerator, model)
    state: Any
    if pipeline_size(accelerator) > 1:  # each process holds its stages' weights: gathered on the main process
        stages = {name: full(tensor).detach().cpu() for name, tensor in model.state_dict().items()}  # FSDP: gathered
        parts = gather_object([stages])
        state = {name: tensor for part in parts for name, tensor in part.items()}
    elif is_sharded(accelerator, model):  # FSDP or tensor parallel: a collective; full tensors on the main process
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(accelerator.unwrap_model(model), options=options)
    else:
        state = get_model_state_dict(accelerator.unwrap_model(model))  # torch.compile's _orig_mod names stripped
    if accelerator.is_main_process:
        final_dir = run_dir / "final" / "ema" if ema else run_dir / "final"
        final_dir.mkdir(parents=True, exist_ok=True)
        exported = recipe.build_model(cfg)
        exported.load_state_dict({k: v.detach().cpu() for k, v in state.items()})
        exported = write_model_folder(exported, final_dir)
        save_tokenizer(recipe.tokenizer, final_dir)
        (final_dir / "config.yaml").write_text(config_to_yaml(cfg))
        files.follow_umask(*(path for path in final_dir.rglob("*") if path.is_file()))
        if not ema:
            recipe.write_artifacts(exported.eval(), eval_set, run_dir)
    accelerator.wait_for_everyone()


def write_model_folder(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """Write `model` into `folder` as its kind is loaded; returns the model the folder holds.

    A transformers model: `save_pretrained` (model.safetensors, config.json), for `from_pretrained(folder)`. A peft
    model: its adapter in `folder/adapter` (`PeftModel.from_pretrained(base, folder / "adapter")`), and the base
    with the adapter merged in `folder` itself, so the folder loads as a plain transformers model. A 4-bit base
    (QLoRA) is merged as the full-precision weights its 4 bits stand for: the model that trained, whose logits
    the adapter's evaluation measured. A
    `PolicyAndReference` (a preference tune): its policy alone, as the above. Anything else:
    `model.safetensors`. Every name of tied weights is written (as copies), so `load_state_dict` takes the file.
    """
    from safetensors.torch import save_file

    model = policy_of(model)  # a preference tune's frozen reference is not the trained model
    if hasattr(model, "peft_config") and hasattr(model, "merge_and_unload"):
        with warnings.catch_warnings():
            if str(base_source(model)).endswith(".gguf"):  # peft looks for a config.json beside the base, in vain
                warnings.filterwarnings("ignore", message="Could not find a config file in")
            model.save_pretrained(folder / "adapter")  # type: ignore[operator]
        model = dequantize(model).merge_and_unload()  # type: ignore[operator]  # QLoRA: into the dequantized base
    weights = state_files.writable(model.state_dict())
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(folder, state_dict=weights)  # type: ignore[operator]
    else:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective over its mesh), or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
