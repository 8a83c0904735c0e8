"""The state of a pipeline run, whose processes each hold the weights and optimizer state of their stages.

A pipeline checkpoint is a sharded (DCP) save like FSDP's: each process writes its own tensors under the
names a one-process run uses. The optimizer's skeleton (its structure and hyperparameters, stored beside the
tensors) is merged from every process's, and cut back to the process's own parameters on load, so a pipeline
checkpoint loads on one process and a one-process checkpoint into a pipeline. A weight tied across stages
(an LM head and its embedding) is held under a different name on each of its processes; where a checkpoint
has the optimizer state of only one of the names, the others take it.
"""

from __future__ import annotations

from typing import Any

from .state_files import TENSOR


def merge_optimizer_skeletons(skeletons: list[Any]) -> Any:
    """One skeleton of `{"state": {name: ...}, "param_groups": [...]}` from every process's part: states
    joined, and parameter names appended to the group of the same hyperparameters."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for skeleton in skeletons:
        merged["state"].update(skeleton.get("state", {}))
        for group in skeleton.get("param_groups", []):
            settings = _settings(group)
            same = [g for g in merged["param_groups"] if _settings(g) == settings]
            if same:
                same[0]["params"] = same[0]["params"] + [p for p in group["params"] if p not in same[0]["params"]]
            else:
                merged["param_groups"].append({**group, "params": list(group["params"])})
    return merged


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def restrict_optimizer_skeleton(skeleton: Any, names: list[str], tied: list[list[str]]
                                ) -> tuple[Any, dict[str, str]]:  # fmt: skip
    """The part of a merged skeleton for the parameters `names` this process holds (in its optimizer's
    order), and for each tensor it refers to, the key it was saved under. A tied parameter whose own name
    the checkpoint lacks takes the state saved under another name of its group (its tensor keys renamed to
    this process's)."""
    saved = skeleton.get("state", {})
    state: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in names:
        source = name if name in saved else next((alias for group in tied if name in group for alias in group
                                                  if alias in saved), None)  # fmt: skip
        if source is not None:
            state[name] = _renamed(saved[source], f"/state/{source}/", f"/state/{name}/", sources)
    groups = []
    for group in skeleton.get("param_groups", []):
        held = [name for name in names if name in group["params"] or _alias_in(name, group["params"], tied)]
        if held:
            groups.append({**group, "params": held})
    return {**skeleton, "state": state, "param_groups": groups}, sources


def _renamed(entry: Any, old: str, new: str, sources: dict[str, str]) -> Any:
    """`entry` with each tensor key's `old` part replaced by `new`, recording where each came from."""
    if isinstance(entry, list):
        return [_renamed(item, old, new, sources) for item in entry]
    if not isinstance(entry, dict):
        return entry
    if len(entry) == 1 and TENSOR in entry:
        key = entry[TENSOR].replace(old, new, 1)
        sources[key] = entry[TENSOR]
        return {TENSOR: key}
    return {key: _renamed(item, old, new, sources) for key, item in entry.items()}


def _alias_in(name: str, params: list[str], tied: list[list[str]]) -> bool:
    return any(name in group and any(alias in params for alias in group) for group in tied)
