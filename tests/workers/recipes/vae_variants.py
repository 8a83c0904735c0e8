"""VAE variants for checkpoint tests, registered from this folder by the dumping worker.

- `vae_crash_once`: process 1 dies (os._exit) at a chosen micro-batch on the first attempt of an elastic run
  (TORCHELASTIC_RESTART_COUNT=0), to prove that torchrun's restart resumes from the latest checkpoint.
- `vae_heavy`: carries an unused 50M-element parameter so that a save writes ~200 MB and lasts long enough to
  be killed with SIGKILL in the middle.
"""

import os
import time
from dataclasses import dataclass

import torch

import accel_trainer as at

DigitsVAE = at.get_recipe("vae")


@dataclass
class CrashConfig(DigitsVAE.Config):
    crash_at_micro_batch: int = 0
    """On the first attempt, process 1 exits after this many micro-batches (0: never)."""


@at.register_recipe("vae_crash_once")
class CrashOnceVAE(DigitsVAE):
    """VAE whose process 1 dies once, mid-run (elastic restart test)."""

    Config = CrashConfig
    micro_batches_seen = 0

    def compute_loss(self, model, batch):
        CrashOnceVAE.micro_batches_seen += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        rank_one = os.environ.get("RANK") == "1"
        if first_attempt and rank_one and CrashOnceVAE.micro_batches_seen == self.cfg.crash_at_micro_batch:
            os._exit(1)
        return super().compute_loss(model, batch)


@at.register_recipe("vae_heavy")
class HeavyVAE(DigitsVAE):
    """VAE with 50M unused ballast parameters (slow-save test)."""

    def build_model(self, cfg):
        model = super().build_model(cfg)
        model.ballast = torch.nn.Parameter(torch.zeros(50_000_000), requires_grad=False)
        return model


@dataclass
class HangConfig(DigitsVAE.Config):
    hang_at_micro_batch: int = 0
    """Process 1 sleeps for 10 minutes at this micro-batch (0: never), as a process stuck in a collective."""


@at.register_recipe("vae_hang")
class HangingVAE(DigitsVAE):
    """VAE whose process 1 hangs mid-run (the hung-peer test)."""

    Config = HangConfig
    micro_batches_seen = 0

    def compute_loss(self, model, batch):
        if batch["pixels"].is_meta:  # the one call that counts FLOPs (observe/flops.py), not a training micro-batch
            return super().compute_loss(model, batch)
        HangingVAE.micro_batches_seen += 1
        if os.environ.get("RANK") == "1" and HangingVAE.micro_batches_seen == self.cfg.hang_at_micro_batch:
            time.sleep(600)
        return super().compute_loss(model, batch)
