"""What a pipeline layout cannot run yet is refused before any stage is traced, as a LayoutError: one line on a
launch (the pipeline x FSDP batch-shape refusal in tests/layouts/test_pipeline_fsdp.py shows the launch side)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from accel_trainer.errors import LayoutError
from accel_trainer.parallel.pipeline.build import build_pipeline


def never_traced() -> list:
    raise AssertionError("a refused pipeline traced its stages")


@pytest.mark.parametrize(
    ("ema_decay", "sync_batchnorm", "mixed_precision", "refusal"),
    [
        (0.0, False, "fp16", "does not combine with sync_batchnorm or fp16 yet"),
        (0.0, True, "no", "does not combine with sync_batchnorm or fp16 yet"),
        (0.99, False, "bf16", "does not keep an EMA of the weights yet: set ema_decay=0"),
    ],
)
def test_what_a_pipeline_cannot_run_is_refused_before_tracing(ema_decay, sync_batchnorm, mixed_precision, refusal):
    recipe = SimpleNamespace(cfg=SimpleNamespace(ema_decay=ema_decay))
    layout = SimpleNamespace(sync_batchnorm=sync_batchnorm, activation_checkpointing=False)
    accelerator = SimpleNamespace(mixed_precision=mixed_precision, is_main_process=True)
    with pytest.raises(LayoutError, match=refusal):
        build_pipeline(recipe, None, never_traced, 1, layout, accelerator)  # type: ignore[arg-type]
