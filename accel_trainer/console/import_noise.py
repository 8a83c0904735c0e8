"""Lines that importing torchao prints on a CPU-only machine, dropped: they say nothing a user can act on.

transformers imports torchao whenever it is installed (its torchao quantizer, at `import transformers`), so
with the `quantize` extra every run printed, before its first line of its own, two "Failed to load
.../torchao/_C_mxfp8...so: Could not load this library" warnings (torchao's CUDA kernels, absent from a CPU
build) and two of torch's "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by
torch.compile" (torchao registers its enums with a call torch has deprecated). NF4, the only part of torchao
accel-trainer uses on the CPU, needs neither. A logging filter on each of the two loggers drops exactly those
messages; anything else they log prints as before. Canary: tests/unit/test_quantization.py (it fails the day
torchao stops printing them, and this module can go).
"""

from __future__ import annotations

import logging

NOISE = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}
"""Each logger, and the beginnings or parts of the messages of it that are dropped."""


class _DropNoise(logging.Filter):
    def __init__(self, parts: tuple[str, ...]) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


def drop_known_import_noise() -> None:
    """Install the filters, once per process (before transformers is imported)."""
    for name, parts in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropNoise) for existing in logger.filters):
            logger.addFilter(_DropNoise(parts))
