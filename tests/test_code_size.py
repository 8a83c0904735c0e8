"""The library stays readable: small modules with one job, short functions. Prints the sizes it measured.

Budgets: a module of accel_trainer/ at most 300 lines, a function (docstring included) at most 50. A change
that needs more splits the module or the function instead of raising the budget.
"""

from __future__ import annotations

import ast

from conftest import REPO

MODULE_LINES = 300
FUNCTION_LINES = 50
MODULES = sorted((REPO / "accel_trainer").rglob("*.py"))


def function_sizes(source: str) -> dict[str, int]:
    sizes = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            sizes[node.name] = max(sizes.get(node.name, 0), (node.end_lineno or node.lineno) - node.lineno + 1)
    return sizes


def test_modules_and_functions_stay_within_the_line_budget():
    report, too_long = [], []
    for path in MODULES:
        source = path.read_text()
        lines, functions = len(source.splitlines()), function_sizes(source)
        longest = max(functions.items(), key=lambda item: item[1], default=("-", 0))
        name = path.relative_to(REPO / "accel_trainer")
        report.append(f"{name!s:<30} {lines:4d} lines, longest function {longest[0]} ({longest[1]})")
        if lines > MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines > {MODULE_LINES}")
        too_long += [f"{path.relative_to(REPO)}:{name}: {size} lines > {FUNCTION_LINES}"
                     for name, size in functions.items() if size > FUNCTION_LINES]  # fmt: skip
    print("\n" + "\n".join(report))
    assert too_long == []
