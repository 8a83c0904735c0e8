"""Numbers as a person reads them in the console line, report.md and `accel-trainer compare`.

Four significant digits (`.4g`) suit losses and learning rates, but turn a throughput of 50,440 items/s into
`5.044e+04`; from 10,000 up a number is shown whole, with thousands separators, as the run's header already
shows parameter counts (`9,610 parameters`).
"""

from __future__ import annotations

WHOLE_FROM = 9999.5  # where .4g switches to exponent form (9999.5 rounds to 1e+04)
WHOLE_BELOW = 1e15  # beyond it digits stop meaning much: exponent form again


def readable(value: float) -> str:
    """`value` with 4 significant digits, or as a whole number with thousands separators from 10,000 up."""
    return f"{value:,.0f}" if WHOLE_FROM <= abs(value) < WHOLE_BELOW else f"{value:.4g}"
