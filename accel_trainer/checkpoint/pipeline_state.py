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

from torch import nn

from accel_trainer.checkpoint import state_files
from accel_trainer.checkpoint.state_files import TENSOR
from accel_trainer.parallel.pipeline.split import tied_groups


def whole_model_state(whole: nn.Module) -> tuple[dict[str, Any], list[list[str]]]:
    """The whole model's state (for the shapes a checkpoint records) and its groups of tied names."""
    return whole.state_dict(), [sorted(names) for names in tied_groups(whole)]


def optimizer_part(
    skeleton: Any, optimizer_state: dict[str, Any], recorded: dict[str, Any], in_pipeline: bool
) -> tuple[Any, dict[str, str]]:
    """The saved optimizer skeleton cut to this process's parameters, and the keys its tensors were saved
    under, when this run or the checkpoint's is a pipeline (unchanged otherwise)."""
    if not in_pipeline and recorded.get("layout", {}).get("pp_size", 1) == 1:
        return skeleton, {}
    names = [name for group in optimizer_state.get("param_groups", []) for name in group["params"]]
    return restrict_optimizer_skeleton(skeleton, names, recorded.get("tied_parameters", []))


def stages_part(
    model: nn.Module, model_state: dict[str, Any], optimizer_state: Any, skeleton: Any, sources: dict[str, str]
) -> tuple[dict[str, Any], Any]:
    """This process's part of a full (unsharded) checkpoint's model and optimizer state."""
    held = set(model.state_dict())
    saved = state_files.split(optimizer_state, "optimizer")[1]
    keys = state_files.tensor_keys(skeleton)
    return (
        {name: tensor for name, tensor in model_state.items() if name in held},
        state_files.join(skeleton, {key: saved[sources.get(key, key)] for key in keys}),
    )


def merge_optimizer_skeletons(skeletons: list[Any]) -> Any:
    """One skeleton of `{"state": {name: ...}, "param_groups": [...]}` from every process's part: states
    joined, and each process's parameter names appended to the matching group: the group at the same place
    when every process has as many groups (groups of equal settings stay apart), else the group of the same
    settings."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    by_position = len({len(skeleton.get("param_groups", [])) for skeleton in skeletons}) == 1
    for skeleton in skeletons:
        merged["state"].update(skeleton.get("state", {}))
        for index, group in enumerate(skeleton.get("param_groups", [])):
            groups = merged["param_groups"]
            same = groups[index : index + 1] if by_position else [g for g in groups if _settings(g) == _settings(group)]
            if same:
                same[0]["params"] = same[0]["params"] + [p for p in group["params"] if p not in same[0]["params"]]
            else:
                groups.append({**group, "params": list(group["params"])})
    return merged


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def restrict_optimizer_skeleton(skeleton: Any, names: list[str], tied: list[list[str]]) -> tuple[Any, dict[str, str]]:
    """The part of a merged skeleton for the parameters `names` this process holds (in its optimizer's
    order), and for each tensor it refers to, the key it was saved under. A tied parameter whose own name
    the checkpoint lacks takes the state saved under another name of its group (its tensor keys renamed to
    this process's)."""
    saved = skeleton.get("state", {})
    state: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in names:
        source = (
            name
            if name in saved
            else next((alias for group in tied if name in group for alias in group if alias in saved), None)
        )
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
