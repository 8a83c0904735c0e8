"""The BatchNorm classifier on a pretend memory budget: a micro-batch larger than `fits_up_to` samples raises
the CUDA out-of-memory error after its forward pass (its BatchNorm statistics already moved), on every process
or on one, so `micro_batch_size=auto` can be tested on the CPU."""

from dataclasses import dataclass

import torch

import accel_trainer as at

BatchNormClassifier = at.get_recipe("batchnorm")  # discovered from this folder before this module (sorted names)


@dataclass
class TightConfig(BatchNormClassifier.Config):
    fits_up_to: int = 1_000_000
    """The largest micro-batch that "fits" (0: not even one sample)."""
    tight_rank: int = -1
    """The only process with the budget; -1: all of them."""


@at.register_recipe("tight_memory")
class TightMemory(BatchNormClassifier):
    """BatchNorm classifier that runs out of (pretend) memory above fits_up_to samples per micro-batch."""

    Config = TightConfig

    def compute_loss(self, model, batch):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        too_big = len(batch["x"]) > self.cfg.fits_up_to and self.cfg.tight_rank in (-1, rank)
        if too_big and len(batch["x"]) == 1:  # before BatchNorm, which refuses a single sample in training
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (pretend, tests/workers/recipes)")
        loss = super().compute_loss(model, batch)
        if too_big:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (pretend, tests/workers/recipes)")
        return loss
