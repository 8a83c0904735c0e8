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

from accelerate.utils import TorchDynamoPlugin

from .errors import LayoutError
from .layout import LayoutSettings

WARN_AFTER_LOG_STEPS = 3  # log records before which new graphs are expected (first shapes, then dynamic ones)


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
