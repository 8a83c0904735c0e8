"""Pretrained bases: where a model's weights come from and where they came from.

`base=` names a `save_pretrained` folder, a hub id found in the local Hugging Face cache, or a `.gguf` file
(dequantized one tensor at a time: contract/loading.py); `check_base` checks it when the config is made,
`load_base_model` and `load_base_tokenizer` read it. `base_source` is the one place that reads transformers' and
peft's records of where a built model came from (checkpoints fingerprint the base, FSDP's RAM-efficient loading
reads a base on the main process only)."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from accel_trainer.contract.loading import gguf_stream, nf4_while_loading, pread_files
from accel_trainer.contract.quantization import check_scheme, is_quantized, quantize_base, stored_parts
from accel_trainer.errors import ConfigError


def base_source(model: torch.nn.Module) -> str | None:
    """The folder or hub name a transformers or peft model was loaded from, or None."""
    adapters = getattr(model, "peft_config", None)
    adapters = adapters if isinstance(adapters, dict) else {}  # a peft model's, by adapter name
    names = [getattr(adapter, "base_model_name_or_path", None) for adapter in adapters.values()]
    name = next(filter(None, names), None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return None
    return str(Path(name).resolve()) if Path(name).is_dir() else str(name)


def weights_digest(named: Mapping[str, torch.Tensor]) -> str:
    """A SHA-256 of the tensors' names, dtypes, shapes and contents (of their shapes alone on the meta device); a
    4-bit weight's contents are its packed values and scales, and its kind is part of the digest."""
    digest = hashlib.sha256()
    for name in sorted(named):
        tensor = named[name].detach()
        kind = "|nf4" if is_quantized(tensor) else ""
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}{kind}|".encode())
        for part in stored_parts(tensor) if tensor.device.type != "meta" else ():
            digest.update(part.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)  # its buffer: no copy
    return digest.hexdigest()


def quiet_progress_bars() -> None:
    """transformers' and huggingface_hub's progress bars off in this process ("Loading weights" at every build,
    "Writing model shards" at every save: three or four bars a run between the framework's own lines). The
    environment variable covers a later import of transformers; `HF_HUB_DISABLE_PROGRESS_BARS=0` keeps them."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "0":
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def installed_file(name: str) -> str | None:
    """The absolute path of a file called `name` that an installed distribution ships (the README's GGUF comes in
    a package); None where none does."""
    for distribution in importlib.metadata.distributions():
        for file in distribution.files or ():
            if file.name == name:
                return str(Path(str(distribution.locate_file(file))).resolve())
    return None


def check_base(base: str) -> str:
    """A `base=` value checked when the config is made, as the run will keep it: a `save_pretrained` folder or a
    `.gguf` file as an absolute path (the run's config.yaml and checkpoints then name it from any folder; a bare
    file name that is not here, the file of that name an installed package ships: the README's), a hub id
    as it is, once it is in the local Hugging Face cache (or may be fetched: HF_HUB_OFFLINE unset).

    Raises:
        ConfigError: a run folder (naming its final/), a folder with no config.json, a missing file, or a hub id
            that is not cached while offline (saying how to fetch it).
    """
    path = Path(base).expanduser()
    if path.suffix == ".gguf":
        if path.is_file():
            return str(path.resolve())
        installed = installed_file(path.name)
        if installed and str(path) == path.name:  # a bare file name, not here: the one a package ships (README)
            return installed
        hint = f"; the one an installed package ships is base={installed}" if installed else ""
        raise ConfigError(f"base={base}: no such GGUF file{hint}")
    if path.is_dir():
        if not (path / "config.json").is_file() and (path / "final" / "config.json").is_file():
            raise ConfigError(f"base={base} is a run folder; its model is base={path / 'final'}")
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"base={base} is not a pretrained model's folder (no {path / 'config.json'}): give a folder that"
                " save_pretrained wrote (such as a run's final/), a .gguf file or a hub id"
            )
        return str(path.resolve())
    if not is_hub_id(base):
        raise ConfigError(f"base={base}: no such folder or file (nor a hub id, which reads org/name)")
    if cached_snapshot(base) is None and _offline():
        raise ConfigError(
            f"base={base} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: fetch it first with"
            f" `hf download {base}` where the hub can be reached, or give a local folder or .gguf file"
        )
    return base


def load_base_model(base: str, quantize: str = "none", **options: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained` of a checked base, its linear weights quantized as they are read with
    `quantize="nf4"` (QLoRA: never the whole base in full precision at once; contract/loading.py). A GGUF file is
    dequantized one tensor at a time (contract/loading.py) and recorded under its path, so checkpoints and FSDP's
    loading know where it came from.

    Built where parameters get no memory (`estimate`'s fake tensors, a meta default device or accelerate's
    `init_empty_weights`: the FLOP count, FSDP's other processes, the final save's copy, which are given their
    weights afterwards), the base's config makes it and no weight is read: a GGUF's dequantizing needs real memory
    (and 9 s for a 135M model on a CPU core), and transformers compares tied weights' values, which fake tensors
    do not have.

    Raises:
        RecipeError: `quantize` is not a scheme (quantization.SCHEMES), or nf4 without torchao.
    """
    from transformers import AutoModelForCausalLM

    quantizing = check_scheme(quantize)
    config = base_config(base)
    if _weights_unwanted():  # eval, as from_pretrained returns a model
        return plain_after_loading(AutoModelForCausalLM.from_config(config).eval(), base)
    folder, gguf_file = _files(base)
    skeleton: Any = None  # the names and shapes the weights are read into
    if gguf_file or quantizing:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    stream = gguf_stream(str(Path(folder, gguf_file)), skeleton) if gguf_file else None
    if gguf_file and stream is None:  # an architecture that transformers reads whole: quantized afterwards
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, gguf_file=gguf_file, **options)
        return quantize_base(plain_after_gguf(model, base), quantize)
    if quantizing:
        options["quantization_config"] = nf4_while_loading(skeleton)
    if stream is not None:  # dtype: transformers' GGUF reading's, the default one
        model = type(skeleton).from_pretrained(
            None, config=config, state_dict=stream, dtype=torch.get_default_dtype(), **options
        )
    else:
        with pread_files() if quantizing else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(folder, config=config, **options)
    if quantizing:  # its 4-bit weights stay as read; the embedding and head go to 16 bits (frozen_in_16_bits.py)
        quantize_base(model, quantize)
    return plain_after_loading(model, base) if quantizing or stream is not None else model


def _weights_unwanted() -> bool:
    """Whether a model built here would get no memory for its weights: estimate's fake tensors, a meta default
    device, or accelerate's `init_empty_weights` (which moves each parameter to meta as it is registered)."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None or torch.get_default_device().type == "meta":
        return True
    probe = torch.nn.Module()
    probe.register_parameter("probe", torch.nn.Parameter(torch.empty(0, device="cpu")))
    return bool(probe.probe.is_meta)


def plain_after_loading(model: Any, base: str) -> Any:
    """A model `load_base_model` built other than by `from_pretrained(folder)` (with a quantization config, from a
    GGUF stream, from its config), as the plain model the rest of the framework sees, recorded under `base` (as
    `plain_after_gguf` leaves transformers' own GGUF reading; peft writes it into an adapter's config as the
    base's path): transformers marks a model it quantized while loading (`hf_quantizer`, the config's
    `quantization_config` and `_is_quantized`), which its own `remove_quantization_config` and the line below
    undo, so peft, TRL and final/ see the model `quantize_base` leaves, linear weights that are 4-bit tensors."""
    from transformers import PreTrainedModel

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for module in model.modules():  # where transformers' _assign_is_quantized marks them
        if isinstance(module, PreTrainedModel):
            vars(module.config).pop("_is_quantized", None)
    vars(model).update(name_or_path=base)  # peft records name_or_path
    model.config._name_or_path = base
    return model


def base_config(base: str) -> Any:
    """The base's `AutoConfig`, a fresh copy each call (a model owns and changes its config). A GGUF file's is read
    once per process: transformers parses the whole file's metadata for it (its tokenizer's 49k tokens and merges
    included: 8 s a read on a CPU core for SmolLM2-135M), and a run builds its model several times (the FLOP count,
    the final save)."""
    folder, gguf_file = _files(base)
    if gguf_file is None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder)
    stat = Path(folder, gguf_file).stat()
    return copy.deepcopy(_gguf_config(folder, gguf_file, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _gguf_config(folder: str, gguf_file: str, mtime_ns: int, size: int) -> Any:
    """A GGUF file's config, by its path and its modification time and size (a file rewritten is read anew)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, gguf_file=gguf_file)


def plain_after_gguf(model: Any, base: str) -> Any:
    """A model transformers read from a GGUF file, as the plain model it is once dequantized: transformers leaves it
    marked quantized (`is_quantized`, a GGUF `hf_quantizer`, the config's `quantization_config`), so its own Trainer
    and TRL refuse to train it ("purely quantized models") and its final/ would claim to be a GGUF checkpoint; and
    it names the file's own title ("Smollm2 135M 8k ...") as where it came from, not the file. Canary:
    tests/test_real_models.py."""
    del model.config.quantization_config
    vars(model).update(hf_quantizer=None, is_quantized=False, name_or_path=base)  # peft records name_or_path
    model.config._name_or_path = base
    return model


def load_base_tokenizer(base: str) -> Any:
    """The base's own tokenizer (`AutoTokenizer.from_pretrained`, a GGUF file's from its metadata), with a padding
    token: its own, else its end-of-text token, as TRL pads."""
    from transformers import AutoTokenizer

    folder, gguf_file = _files(base)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    except (OSError, ValueError) as error:
        if folder == base and is_hub_id(base) and not Path(base).exists():  # not cached, and fetching failed
            raise ConfigError(
                f"base={base} is not in the Hugging Face cache and could not be fetched ({_first_line(error)}):"
                f" fetch it with `hf download {base}` where the hub can be reached, or give a local folder or"
                " .gguf file"
            ) from None
        raise ConfigError(f"base={base} has no tokenizer that transformers can read: {_first_line(error)}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def base_context(model: Any) -> int:
    """The longest sequence the model's positions allow (0: no limit known)."""
    return config_context(model.config)


def base_config_context(base: str) -> int:
    """`base_context` of a checked base, read from its config alone (no weight is loaded)."""
    from transformers import AutoConfig

    folder, gguf_file = _files(base)
    return config_context(AutoConfig.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {})))


def config_context(config: Any) -> int:
    return int(getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", 0) or 0)


def cached_snapshot(repo_id: str) -> str | None:
    """The folder of `repo_id`'s newest snapshot in the local Hugging Face cache, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return str(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _files(base: str) -> tuple[str, str | None]:
    """The folder from_pretrained reads, and the GGUF file's name in it."""
    path = Path(base)
    if path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir():
        return base, None
    return cached_snapshot(base) or base, None  # not cached: transformers fetches it


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a hub repository id (org/name, or a bare name), as huggingface_hub checks one."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError:
        return False
    return True


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
