"""`compile=true`: torch.compile through accelerate's TorchDynamoPlugin, regional, and its recompilations counted.

accelerate compiles the model in `prepare`. Regional compilation (`use_regional_compilation`) compiles each
block of a repeated stack (the GPT's `blocks`) separately, so one compilation serves all of them: the
cold start of a deep model is that of one block. The module names it leaves (`blocks.0._orig_mod.q`) are
stripped by torch's state-dict functions, so checkpoints and `final/` keep the uncompiled names and load on
any layout, compiled or not. The backend is inductor unless the accelerate config's `dynamo_config` names
another (that section alone turns compilation on too: accelerate would otherwise compile the whole model
silently).

A shape the compiled code has not seen costs a recompilation (seconds on the CPU); torch then marks the
changing dimension dynamic, so variable-length batches settle after one. `CompileWatch` reads dynamo's count of
compiled graphs at each log step: it goes into the log record as `compiled_graphs`, and a count still rising
after the first log steps is warned about once, with what to do.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch._dynamo
from accelerate.utils import TorchDynamoPlugin
from torch._dynamo.eval_frame import OptimizedModule

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.errors import LayoutError

WARN_AFTER_LOG_STEPS = 3  # log records before which new graphs are expected (first shapes, then dynamic ones)
RECOMPILES_PER_REGION = 8  # dynamo's own default recompile_limit for one function


def dynamo_plugin(layout: LayoutSettings) -> TorchDynamoPlugin:
    """The plugin for `Accelerator(dynamo_plugin=...)`: regional compilation when asked, else backend "no"."""
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper()
    if not layout.compile and backend == "NO":
        return TorchDynamoPlugin(backend="no")
    if layout.tp_size > 1 or layout.pp_size > 1:
        raise LayoutError(
            "compile=true with tensor or pipeline parallelism is not supported yet: set compile=false (and"
            " dynamo_backend: 'NO' in the accelerate config)"
        )
    return TorchDynamoPlugin(backend="inductor" if backend == "NO" else backend.lower(), use_regional_compilation=True)


def allow_recompiles_per_region(model: torch.nn.Module) -> None:
    """Give every compiled region dynamo's default allowance of compiled variants.

    accelerate's regional compilation wraps each region (a block, and every other child: embeddings, dropout,
    norms, the head) in `torch.compile`, and all those wrappers run through one code object (dynamo's
    `external_utils.inner`), whose cache holds at most `recompile_limit` (8) variants for the whole model: the
    GPT's five other regions in train and eval mode used them up at its first evaluation, after which new
    variants ran eager, each with a block of torch warnings (found by a new-user trial). The canary in
    tests/unit/parallel/test_compiling.py fails when two compiled modules stop sharing that cache; this can go then.
    """
    regions = sum(isinstance(module, OptimizedModule) for module in model.modules())
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILES_PER_REGION * regions)


class CompileWatch:
    """Counts the graphs dynamo compiled, for the log record, and warns once when they keep coming."""

    def __init__(self, enabled: bool, warn: bool) -> None:
        self.enabled, self.warn = enabled, warn
        self.log_steps, self.warned, self.last = 0, False, 0

    def record(self, step: int) -> dict[str, int]:
        if not self.enabled:
            return {}
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"]["unique_graphs"])
        self.log_steps += 1
        rising = graphs > self.last and self.log_steps > WARN_AFTER_LOG_STEPS
        if rising and self.warn and not self.warned:
            self.warned = True
            warnings.warn(
                f"accel-trainer: torch.compile compiled {graphs - self.last} new graph(s) before step {step}, after"
                f" {WARN_AFTER_LOG_STEPS} log steps: batch shapes keep changing (pad them to a few fixed lengths) or"
                " the model branches on values; each recompilation costs seconds",
                stacklevel=2,
            )
        self.last = graphs
        return {"compiled_graphs": graphs}
