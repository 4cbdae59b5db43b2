"""Optimizer state keyed by (global layer index, parameter name), so it loads
into any partition."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from raypipe.stage.gradients import whole_tensor


def _named_parameters(layers: nn.ModuleList, layer_indices: list[int]):
    for index, layer in zip(layer_indices, layers):
        for name, parameter in layer.named_parameters():
            yield index, name, parameter


def gather_optimizer_state(optimizer: torch.optim.Optimizer | None, layers: nn.ModuleList,
                           layer_indices: list[int], on_host: bool = True) -> dict[int, dict[str, Any]]:
    """``{layer: {param_name: state}}`` plus the hyper-parameters under key -1; tensors on
    the host (``on_host=False``: the live tensors, for a caller that copies them itself). The
    state of a parameter split over a tensor-parallel mesh is gathered whole (a collective:
    every rank of the mesh gathers the same states in the same order)."""
    if optimizer is None:
        return {}
    states: dict[int, dict[str, Any]] = {index: {} for index in layer_indices}
    for index, name, parameter in _named_parameters(layers, layer_indices):
        state = optimizer.state.get(parameter)
        if state:
            states[index][name] = {k: (whole_tensor(v).detach().cpu() if on_host else whole_tensor(v))
                                   if torch.is_tensor(v) else v for k, v in state.items()}
    states[-1] = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
    return states


def scatter_optimizer_state(optimizer: torch.optim.Optimizer | None, layers: nn.ModuleList,
                            layer_indices: list[int], states: dict[int, dict[str, Any]],
                            split: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Inverse of :func:`gather_optimizer_state` for this stage's layers.

    Every tensor is placed where torch's own ``Optimizer.load_state_dict`` would place it
    (see :func:`place_state`): a fused or capturable AdamW finds its ``step`` on the
    parameter's device, a plain one on the host. ``split(value, parameter)``: a state tensor laid
    out as the parameter is (split over a tensor-parallel mesh), or left as it is when it is not
    shaped like the parameter (a scalar step): a whole one or, adopted from a snapshot, this
    rank's local part.
    """
    if optimizer is None or not states:
        return
    # the saved hyper-parameters first: like load_state_dict, placement follows the saved
    # groups' ``fused`` / ``capturable``
    for group, saved in zip(optimizer.param_groups, states.get(-1, {}).get("param_groups", [])):
        group.update(saved)
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}  # ZeRO-1: owned only
    for index, name, parameter in _named_parameters(layers, layer_indices):
        state = states.get(index, {}).get(name)
        group = group_of.get(id(parameter))
        if state is not None and group is not None:
            placed = place_state(parameter, state, group)
            if split is not None:
                placed = {key: split(value, parameter) if torch.is_tensor(value) else value
                          for key, value in placed.items()}
            optimizer.state[parameter] = placed


def place_state(parameter: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    """One parameter's optimizer state, its tensors cast and moved as ``Optimizer.load_state_dict``
    does for ``parameter`` in ``group``: floating state to the parameter's dtype and device;
    ``step`` left as it is (a host float32), unless the group is fused or capturable, then a
    float32 on the parameter's device. Delegates to torch's own rule, so the two cannot drift."""
    # torch's rule looks the parameter's group up by id among plain dicts of ids
    groups = [{"params": [0], "fused": group.get("fused") or False, "capturable": group.get("capturable") or False}]

    def place(value: Any, key: Any = None) -> Any:
        if torch.is_tensor(value):
            return torch.optim.Optimizer._process_value_according_to_param_policy(parameter, value, 0, groups, key)
        if isinstance(value, dict):
            return {k: place(v, k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(place(v) for v in value)
        return value

    return {key: place(value, key) for key, value in state.items()}
