"""Optimizer state keyed by (global layer index, parameter name), so it loads
into any partition."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _named_parameters(layers: nn.ModuleList, layer_indices: list[int]):
    for index, layer in zip(layer_indices, layers):
        for name, parameter in layer.named_parameters():
            yield index, name, parameter


def gather_optimizer_state(optimizer: torch.optim.Optimizer | None, layers: nn.ModuleList,
                           layer_indices: list[int], on_host: bool = True) -> dict[int, dict[str, Any]]:
    """``{layer: {param_name: state}}`` plus the hyper-parameters under key -1; tensors on
    the host (``on_host=False``: the live tensors, for a caller that copies them itself)."""
    if optimizer is None:
        return {}
    states: dict[int, dict[str, Any]] = {index: {} for index in layer_indices}
    for index, name, parameter in _named_parameters(layers, layer_indices):
        state = optimizer.state.get(parameter)
        if state:
            states[index][name] = {k: (v.detach().cpu() if on_host else v) if torch.is_tensor(v) else v
                                   for k, v in state.items()}
    states[-1] = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
    return states


def scatter_optimizer_state(optimizer: torch.optim.Optimizer | None, layers: nn.ModuleList,
                            layer_indices: list[int], states: dict[int, dict[str, Any]]) -> None:
    """Inverse of :func:`gather_optimizer_state` for this stage's layers."""
    if optimizer is None or not states:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}  # ZeRO-1: owned only
    for index, name, parameter in _named_parameters(layers, layer_indices):
        state = states.get(index, {}).get(name)
        if state is not None and id(parameter) in stepped:
            optimizer.state[parameter] = {k: v.to(parameter.device) if torch.is_tensor(v) and v.dim() > 0 else v
                                          for k, v in state.items()}
    for group, saved in zip(optimizer.param_groups, states.get(-1, {}).get("param_groups", [])):
        group.update(saved)
