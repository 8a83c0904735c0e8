"""The run's final weights: `final/model.safetensors` (or a transformers folder) and the recipe's artifacts.

The file is a plain state dict with every name of the model's: a tied weight (an LM head and its token
embedding) is stored under each of its names, as in checkpoints. safetensors cannot alias two names to one
tensor, and both `save_model` and transformers' `save_pretrained` keep only one name, so
`model.load_state_dict(load_file("final/model.safetensors"))` on a freshly built model failed on the other
(strict). The price is one more copy of each tied tensor on disk. (safetensors' `load_model` refuses the second
name as unexpected: load with `load_state_dict`.)

A transformers model whose config ties weights (`tie_word_embeddings`) is the exception: its folder is what
`from_pretrained` reads, which ties the weights again, so each tied tensor is stored once, under the name
transformers keeps (SmolLM2-135M's final/ is 113 MB smaller); `with_tied_names` gives a reader that loads the
file with `load_state_dict` the names it leaves out.

The trained weights go into a copy of the recipe's model built without weights (accelerate's
`init_empty_weights`: a pretrained base is not read again, contract/pretrained.load_base_model), which works the
same whether the trained model is plain, DDP-wrapped or sharded, and which holds the trained tensors themselves:
the export copies only the weights a LoRA merge changes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, init_empty_weights
from accelerate.utils import gather_object
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from accel_trainer.checkpoint import files, merged_weights, state_files
from accel_trainer.checkpoint.tokenizer import save_tokenizer
from accel_trainer.config.train_config import TrainConfig, config_to_yaml
from accel_trainer.contract.frozen_in_16_bits import computation_dtype, held_again, held_in_16_bits
from accel_trainer.contract.pretrained import base_source
from accel_trainer.contract.quantization import dequantize, is_quantized
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

    The weights are loaded into a copy of the recipe's model built without weights (`model_holding`).
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
        held = held_in_16_bits(accelerator.unwrap_model(model))  # QLoRA's embedding and head: kept in 16 bits
        exported = write_model_folder(model_holding(recipe, cfg, state, held), final_dir)
        save_tokenizer(recipe.tokenizer, final_dir)
        (final_dir / "config.yaml").write_text(config_to_yaml(cfg))
        files.follow_umask(*(path for path in final_dir.rglob("*") if path.is_file()))
        if not ema:
            recipe.write_artifacts(exported.eval(), eval_set, run_dir)
    accelerator.wait_for_everyone()


def model_holding(recipe: Recipe, cfg: TrainConfig, state: dict[str, torch.Tensor], held: Any = ()) -> torch.nn.Module:
    """The recipe's model holding `state` (the trained weights, on the CPU), as a fresh build loaded with
    `load_state_dict` would: in the dtypes it builds, strict about names and shapes, its tied weights one
    parameter. It is built under accelerate's `init_empty_weights` (parameters on meta, buffers real) and handed
    the trained tensors themselves (`assign`), so no weight is read or held twice: a pretrained base is not read
    again (9 s and 1.2 GB for a 135M GGUF file), and the export copies only what it changes (`write_model_folder`:
    the weights a LoRA merge adds into). A recipe whose model cannot be built without weights is built whole. The
    names in `held` (QLoRA's embedding and head, held in 16 bits: frozen_in_16_bits.py) stay in their 16 bits."""
    try:
        with init_empty_weights(include_buffers=False):
            model = recipe.build_model(cfg)
    except Exception:  # noqa: BLE001 - a build that needs its values (reads them): the same model, built whole
        model = recipe.build_model(cfg)
    tensors = _as_built(state, model.state_dict(keep_vars=True), held)
    model.load_state_dict(tensors, assign=True)
    _tie_again(model, tied_groups(tensors))
    if held:
        held_again(model, held)
    return model


def _as_built(state: dict[str, torch.Tensor], built: dict[str, torch.Tensor], held: Any) -> dict[str, torch.Tensor]:
    """`state`'s tensors in the dtypes of the `built` model's (a cast copy only where they differ; a 4-bit weight
    as it is), each tensor held under several names (tied) one object."""
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    result = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        if is_quantized(tensor) or not tensor.numel():  # no storage of its own to tell it by (never tied)
            result[name] = tensor
            continue
        if name in built and built[name].dtype != tensor.dtype and name not in held:
            tensor = tensor.to(built[name].dtype)
        view = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        result[name] = seen.setdefault(view, tensor)
    return result


def _tie_again(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Make each group of names one parameter again: `assign` gave each name a parameter of its own, and so does a
    build under `init_empty_weights` (it registers each name's parameter anew). The groups are the names that held
    one tensor in the trained model; a transformers model also ties what its config ties (`tie_weights`), as its
    fresh build did: a gathered FSDP state holds a copy per name (peft's merge then wrote `tie_word_embeddings:
    false` into final/config.json)."""
    for names in groups:
        for name in names[1:]:
            module, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module), leaf, model.get_parameter(names[0]))
    for transformers_model in [m for m in model.modules() if hasattr(m, "get_expanded_tied_weights_keys")]:
        transformers_model.tie_weights()  # type: ignore[operator]  # a peft model's base, a policy, the model itself


def tied_groups(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names under which `tensors` holds one tensor (tied weights), each group in order."""
    names: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        names.setdefault(id(tensor), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def with_tied_names(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (a final/model.safetensors read) with each tied name of `model` it leaves out (a transformers
    model's final/ stores a tied tensor once) given the tensor of its group that it holds, so that
    `model.load_state_dict` takes it strictly."""
    weights = dict(weights)
    for names in tied_groups(dict(model.named_parameters(remove_duplicate=False))):
        held = [weights[name] for name in names if name in weights]
        for name in names if held else []:
            weights.setdefault(name, held[0])
    return weights


def write_model_folder(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """Write `model` into `folder` as its kind is loaded; returns the model the folder holds (a peft model's: the
    model itself, its adapter unmerged, where its merge is written one weight at a time).

    A transformers model: `save_pretrained` (model.safetensors, config.json), for `from_pretrained(folder)`. A peft
    model: its adapter in `folder/adapter` (`PeftModel.from_pretrained(base, folder / "adapter")`), and the base
    with the adapter merged in `folder` itself, so the folder loads as a plain transformers model; merged one
    weight at a time (merged_weights.py) where it holds LoRA layers alone, else all at once. A 4-bit base
    (QLoRA) is merged as the full-precision weights its 4 bits stand for: the model that trained, whose logits
    the adapter's evaluation measured. A `PolicyAndReference` (a preference tune): its policy alone, as the above.
    Anything else: `model.safetensors`. Every name of tied weights is written (as copies), so `load_state_dict`
    takes the file, but those a transformers model's config ties, which `from_pretrained` ties again (written
    once).
    """
    from safetensors.torch import save_file

    model = policy_of(model)  # a preference tune's frozen reference is not the trained model
    if hasattr(model, "peft_config") and hasattr(model, "merge_and_unload"):
        with warnings.catch_warnings():
            if str(base_source(model)).endswith(".gguf"):  # peft looks for a config.json beside the base, in vain
                warnings.filterwarnings("ignore", message="Could not find a config file in")
            model.save_pretrained(folder / "adapter")  # type: ignore[operator]
        if merged_weights.streamable(model):  # one merged weight held at a time
            base: Any = model.get_base_model()  # type: ignore[operator]
            base.save_pretrained(folder, state_dict={})  # transformers' config.json and generation_config.json
            if held_in_16_bits(base):  # its dtype is its first parameter's, the embedding's: held, not computed in
                base.config.dtype = str(computation_dtype(base)).removeprefix("torch.")
                base.config.save_pretrained(folder)
            merged_weights.write_merged(model, folder / "model.safetensors", left_out=tied_by_config(base))
            return model
        model = merged(model)
    if hasattr(model, "save_pretrained"):
        tied = tied_by_config(model)
        weights = state_files.writable({k: v for k, v in model.state_dict().items() if k not in tied})
        model.save_pretrained(folder, state_dict=weights)  # type: ignore[operator]
    else:
        save_file(
            state_files.writable(model.state_dict()), str(folder / "model.safetensors"), metadata={"format": "pt"}
        )
    return model


def merged(model: Any) -> Any:
    """peft's `merge_and_unload` of `model`, which adds each adapter into its base layer's weight in place, into
    weights of the merge's own: a 4-bit one dequantized (QLoRA: the full-precision weight its 4 bits stand for,
    `quantization.dequantize`), any other copied, as the weights may be the trained model's (`model_holding`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in [module for module in model.modules() if isinstance(module, BaseTunerLayer)]:
        base: Any = layer.get_base_layer()
        if not is_quantized(base.weight):
            base.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)  # frozen, as LoRA's
    return dequantize(model).merge_and_unload()  # type: ignore[operator]


def tied_by_config(model: Any) -> set[str]:
    """The names of a transformers model's weights that its config ties to another (`tie_word_embeddings`: its
    LM head) and that hold that other one's values, which `from_pretrained` gives them again."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    declared = model.get_expanded_tied_weights_keys(all_submodels=True)  # {tied name: the name it is tied to}
    return {
        name
        for name, to in declared.items()
        if name in parameters and to in parameters and torch.equal(parameters[name], parameters[to])
    }


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective over its mesh), or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
