"""A layer's checkpoint parts: the layer file the first replica writes, and with
ZeRO-1 one blob per other replica holding the optimizer state of the parameters
it owns (and, in bf16, their fp32 main weights, which no other replica keeps)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from raypipe.checkpoint.store import read_blob, read_layer


def optimizer_part_name(layer_index: int, replica: int) -> str:
    """The checkpoint blob of replica ``replica``'s part of one layer (ZeRO-1)."""
    return f"optimizer-layer{layer_index:05d}-part{replica}"


def read_layer_parts(root_uri: str | Path, step: int, layer_index: int, num_parts: int = 1) -> list[dict[str, Any]]:
    """Every part of layer ``layer_index`` in checkpoint ``step``, the layer file first."""
    return [read_layer(root_uri, step, layer_index)] + [
        read_blob(root_uri, step, optimizer_part_name(layer_index, part)) for part in range(1, num_parts)]


def add_sole_mains(states: dict[int, dict[str, torch.Tensor]],
                   *other_mains: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """The first replica's per-layer ``states`` completed, in place, by the main weights
    each other replica alone keeps (their ``sole_main_weights``)."""
    for mains in other_mains:
        for index, weights in mains.items():
            states[index].update(weights)
    return states


def merged_model(parts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A layer's whole state from its parts: the layer file's model, completed by the
    main weights each other part's replica alone kept."""
    model: dict[str, torch.Tensor] = {}
    for part in parts:
        model.update(part.get("model", {}))
    return model
