"""accel-trainer on one process computes exactly what a hand-written PyTorch loop computes.

Same seed, same data order (accelerate's seedable sampler draws `randperm(n)` from a generator seeded with
`seed + epoch`), same accumulation, clipping, AdamW and warmup-cosine schedule: the final weights must be
bitwise equal. Any hidden extra step, a schedule stepped twice or a mis-scaled accumulation breaks this.
"""

from __future__ import annotations

import math

import datasets
import torch
from safetensors.torch import load_file
from torch import nn

import accel_trainer as at
from accel_trainer.optim.schedules import lr_multiplier


class TinyRegression(at.Recipe):
    """A 2-layer MLP regressing a random linear map (parity test recipe)."""

    def build_model(self, cfg):
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def build_datasets(self, cfg):
        generator = torch.Generator().manual_seed(7)
        x = torch.randn(100, 8, generator=generator)
        y = x @ torch.randn(8, 2, generator=generator)
        return datasets.Dataset.from_dict({"x": x.numpy(), "y": y.numpy()}), None

    def compute_loss(self, model, batch):
        return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def plain_pytorch_loop(cfg: at.TrainConfig) -> dict[str, torch.Tensor]:
    recipe = TinyRegression(cfg)
    torch.manual_seed(cfg.seed)
    model = recipe.build_model(cfg)
    data = recipe.build_datasets(cfg)[0].with_format("torch")
    x, y = data["x"], data["y"]
    decayed = [p for p in model.parameters() if p.ndim >= 2]
    undecayed = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": undecayed, "weight_decay": 0.0}],
        lr=cfg.lr,
        fused=True,  # the default optimizer's kernel on the CPU
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    accumulation = cfg.global_batch_size // cfg.micro_batch_size
    steps_per_epoch = len(data) // cfg.global_batch_size
    step = 0
    for epoch in range(math.ceil(cfg.max_steps / steps_per_epoch)):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        for start in range(0, steps_per_epoch * cfg.global_batch_size, cfg.global_batch_size):
            if step == cfg.max_steps:
                break
            for micro in range(accumulation):
                index = order[start + micro * cfg.micro_batch_size :][: cfg.micro_batch_size]
                loss = nn.functional.mse_loss(model(x[index]), y[index])
                (loss / accumulation).backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
    return {name: p.detach() for name, p in model.state_dict().items()}


def test_one_process_run_equals_a_hand_written_pytorch_loop_bitwise(tmp_path, monkeypatch):
    monkeypatch.setattr(at.registry, "_recipes", {"tiny_regression": TinyRegression})
    settings = dict(
        seed=3,
        max_steps=14,
        global_batch_size=16,
        micro_batch_size=8,
        lr=1e-2,
        warmup_steps=3,
        weight_decay=0.1,
        max_grad_norm=0.5,
        log_every_steps=0,
    )

    at.train("tiny_regression", output_dir=str(tmp_path), show_progress_bar=False, report=False, **settings)

    framework = load_file(str(tmp_path / "final" / "model.safetensors"))
    plain = plain_pytorch_loop(TinyRegression.Config(**settings))
    assert framework.keys() == plain.keys()
    for name in plain:
        assert torch.equal(framework[name], plain[name]), name
