"""The recipe contract: what a user writes to train a model with accel-trainer.

A recipe says *what* to train and nothing about *where*: it never mentions processes, devices or
precision. It is a class with a typed `Config` and a handful of methods the loop calls:

    build_model(cfg)            -> torch.nn.Module (on the CPU; the loop places it)
    build_datasets(cfg)         -> (train, eval or None): datasets.Dataset or IterableDataset, or a torch
                                   map-style Dataset or IterableDataset
    compute_loss(model, batch)  -> a mean loss, or {"loss": sum, "num_items": n, "<term>": t} (contract/losses.py)
    build_optimizer(cfg, model) -> optional; AdamW with decoupled weight decay by default; each param
                                   group's own lr is its peak, which the schedule multiplies; or several
                                   optimizers by name, stepped together or in alternating phases
                                   (`alternate_optimizers`, optim/optimizers.py)
    build_scheduler(cfg, optimizer) -> optional; any torch LR scheduler, stepped once per optimizer step
    eval_metrics(model, batch)  -> optional; per-sample metric tensors, batch means or (sums, num_items)
    collate(examples)           -> optional; how a list of examples becomes a batch
    rollout(model, batches, step) -> optional; the step's micro-batches made into what compute_loss trains on,
                                   with the current weights (online RL samples completions here)
    rollout_schedule()          -> optional; (steps, passes): a rollout feeds that many steps, that many times
    wrap_classes                -> optional class attribute: the block classes FSDP shards as units
    tp_plan                     -> optional class attribute: how tensor parallelism splits modules
    pipeline_split              -> optional class attribute: the modules that begin a pipeline stage
    sequence_dims               -> optional class attribute: the batch tensors context parallelism slices
    write_artifacts(model, eval_dataset, run_dir) -> optional; pictures or reports, main process only
    build_tokenizer(cfg)        -> optional; a transformers tokenizer, kept in `self.tokenizer` before the model
                                   and data are built, written into final/ and fingerprinted in checkpoints

`self.cfg` holds the resolved config, so `compute_loss` can read recipe fields; `self.data_fingerprints` what
build_datasets built the sets from beyond the config (a cache's key), which checkpoints record and a resume checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import default_collate

from accel_trainer.config.train_config import TrainConfig
from accel_trainer.contract.losses import read_loss_output
from accel_trainer.contract.optimizers import built_in_optimizer
from accel_trainer.errors import RecipeError

Batch = Any  # what collate returns: a dict of tensors by default, or tuples or tensors
LossReturn = torch.Tensor | Mapping[str, Any]


class Recipe:
    """Base class of recipes; subclass it, set `Config`, and implement the three required builders."""

    Config: ClassVar[type[TrainConfig]] = TrainConfig
    wrap_classes: ClassVar[tuple[type[torch.nn.Module], ...]] = ()
    """Module classes (transformer or residual blocks) that FSDP shards as units and activation checkpointing
    recomputes; empty shards the model as one unit."""
    tp_plan: ClassVar[dict[str, str]] = {}
    """Module-name patterns (`*` for one component, e.g. a block index) to tensor-parallel styles: "colwise",
    "rowwise", "colwise_gather_output", "embedding", "sequence_parallel" (parallel/tensor_parallel.py); used only on a
    layout with tp_size > 1, which refuses a recipe without one."""
    pipeline_split: ClassVar[tuple[str, ...]] = ()
    """Names of the modules that begin a new pipeline stage (pp_size - 1 of them, e.g. ("blocks.2",)); empty
    spreads the wrap_classes blocks evenly over the stages (parallel/pipeline/split.py)."""
    alternate_optimizers: ClassVar[bool] = False
    """With several optimizers from build_optimizer (a mapping by name): True runs each step as one phase per
    optimizer, in order, calling `compute_loss(model, batch, phase=name)` and stepping that optimizer alone (a
    GAN); False steps them all on the one loss (optim/optimizers.py)."""
    sequence_dims: ClassVar[dict[str, int]] = {}
    """Batch keys to their sequence dimension (e.g. {"input_ids": 1, "targets": 1, "positions": 1}): every
    tensor the model or the loss reads along the sequence, which context parallelism slices (GPU layouts with
    cp_size > 1 only; parallel/context_parallel.py); positions included, since a model's own `arange` would number
    each process's slice from 0."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.tokenizer: Any = None  # build_tokenizer's, once the run has built it
        self.run_dir: Path | None = None
        """The run folder, once training starts: where a recipe writes files of its own during the run."""
        self.data_fingerprints: dict[str, str] = {}
        """What `build_datasets` built the sets from that the files of a run do not hold, by name (a cache of
        precomputed values, by its key): checkpoints record it, and a resume that builds other sets is refused."""

    def build_tokenizer(self, cfg: Any) -> Any:
        """Return the tokenizer of the model's inputs (`AutoTokenizer.from_pretrained` of a local folder, or one
        made with `tokenizers`), or None. The run keeps it in `self.tokenizer`, built before the model and the
        datasets; `final/` holds it, so `AutoTokenizer.from_pretrained(<run>/final)` loads it, and a resume
        whose tokenizer differs from the checkpoint's is refused (checkpoint/tokenizer.py)."""
        return None

    def build_model(self, cfg: Any) -> torch.nn.Module:
        """Return the model, on the CPU; the loop moves, wraps and shards it."""
        raise NotImplementedError(f"{type(self).__name__} must define build_model(self, cfg)")

    def build_datasets(self, cfg: Any) -> tuple[Any, Any]:
        """Return `(train, eval)`; eval may be None. Each is a `datasets.Dataset` or `datasets.IterableDataset`
        (streaming, sharded), a map-style `torch.utils.data.Dataset` or a torch `IterableDataset`. An iterable
        training set has no length: `max_steps` bounds training and each pass to its end is an epoch."""
        raise NotImplementedError(f"{type(self).__name__} must define build_datasets(self, cfg)")

    def compute_loss(self, model: torch.nn.Module, batch: Batch) -> LossReturn:
        """Return the mean loss of the batch (a scalar), or a mapping `{"loss": ..., "num_items": ...}`.

        With `num_items` (for example a token loss summed over the tokens of variable-length sequences, as
        `at.token_cross_entropy` returns it) the loop divides by the item count of the whole optimizer step,
        over all micro-batches and processes, so the gradient is that of one big batch on any layout. Other
        keys of the mapping are extra scalar terms (reconstruction, KL, ...), logged beside `loss` with the
        same normalisation; return the same terms from every micro-batch (a missing one counts as 0).

        It is also called once, after the first step, on a meta-device copy of the model and of the first
        micro-batch, to count the FLOPs behind MFU (observe/flops.py): code with side effects (counters, files)
        should leave batches whose tensors are `is_meta` alone.
        """
        raise NotImplementedError(f"{type(self).__name__} must define compute_loss(self, model, batch)")

    def build_optimizer(self, cfg: Any, model: torch.nn.Module) -> Any:
        """The `optimizer=` key's (contract/optimizers.py): AdamW by default, with weight decay on matrices and
        embeddings only (biases and norm gains are not decayed); Adafactor, SGD, or Muon with AdamW.

        A recipe may return any torch optimizer, or several by name over disjoint parameters, e.g.
        `{"discriminator": Adam(...), "generator": Adam(...)}` (see `alternate_optimizers`).

        torch's fused AdamW kernel where it applies (floating-point parameters on the CPU or CUDA): one kernel
        per parameter group instead of about ten Python-dispatched ops per parameter, 4x faster per step on a
        small CPU model (benchmarks/overhead.py), the same update up to float rounding.
        """
        return built_in_optimizer(cfg, model)

    def build_scheduler(self, cfg: Any, optimizer: torch.optim.Optimizer) -> Any:
        """Return a torch LR scheduler to replace the built-in one (warmup, then cosine, linear or constant).

        The loop steps it once per optimizer step taken (never per process or per micro-batch), saves it in
        each checkpoint and restores it on resume. None (the default) keeps the built-in schedule.
        """
        return None

    def eval_metrics(self, model: torch.nn.Module, batch: Batch) -> dict[str, Any]:
        """Evaluation metrics of a batch of real samples: `{name: value}` (contract/eval_outputs.py), each value

        - a tensor of shape [batch_size], one value per sample: the loop reports its mean over the eval set;
        - a 0-dim tensor or a number, the batch's mean: weighted by the batch's samples, exact too;
        - a pair `(sums, num_items)` (per-sample or per-batch): reported as the total of the sums over the
          total of num_items, a token-weighted mean, say, for that metric alone.

        The loop passes only real samples (never the duplicates that even out the last batch over the
        processes) and combines the sums over all processes. The default reports `loss` from `compute_loss`:
        its batch mean, or its sum over its `num_items`.
        """
        if self.alternate_optimizers:
            raise RecipeError(
                f"{type(self).__name__} alternates optimizers, so it has no single loss to evaluate: define"
                " eval_metrics(model, batch), or return None as the eval set"
            )
        output = read_loss_output(self.compute_loss(model, batch))
        loss = output.loss.detach()
        return {"loss": loss if output.num_items is None else (loss, output.num_items)}

    def collate(self, examples: list[Any]) -> Any:
        """Stack a list of examples (dicts, tuples or tensors) into a batch."""
        return default_collate(examples)

    def rollout(self, model: torch.nn.Module, batches: list[Batch], step: int) -> list[Batch]:
        """Optional: turn optimizer step `step`'s micro-batches (this process's, in order; several steps' with a
        `rollout_schedule`) into the micro-batches `compute_loss` trains on, one for one, with the weights as they
        are before the step: an online RL recipe
        samples completions of the batches' prompts here and scores them (recipes/grpo.py).

        The loop calls it once a step, before any of the step's forwards, without gradients, every process at
        once (a collective over the step's values is allowed: the deviation of all its rewards, say). `model` is
        the trained model without DDP's wrapper, its weights sharded where the layout shards them (FSDP2: each
        forward gathers them, so every process must run as many forwards). Whatever it does with the model's
        mode is undone before the step's forwards. Not on pipeline layouts, nor with alternating optimizers.
        """
        raise NotImplementedError  # never called: the loop calls a recipe's own rollout only

    def rollout_schedule(self) -> tuple[int, int]:
        """Optional, with `rollout`: `(steps, passes)`, TRL's steps_per_generation and num_iterations. The loop then
        runs the rollout once every steps x passes optimizer steps, on `steps` optimizer steps' micro-batches, and
        trains each step on its share of what it made, every share once a pass (checkpoint/generations.py keeps
        them, in checkpoints too). A recipe reusing completions computes their sampling log-probabilities in the
        rollout. (1, 1), the default: a rollout a step, on the step's own micro-batches."""
        return 1, 1

    @classmethod
    def rolls_out(cls) -> bool:
        """Whether the recipe defines its own `rollout`."""
        return cls.rollout is not Recipe.rollout

    def write_artifacts(self, model: torch.nn.Module, eval_dataset: Any, run_dir: Path) -> None:
        """Write pictures or reports into the run folder after training (main process, unwrapped model)."""
