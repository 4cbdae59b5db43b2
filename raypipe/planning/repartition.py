"""Fewer stages when not even one whole pipeline can be placed: how many, and
whether the merged stages fit a worker.

The memory of a merged stage is predicted from what its old stages measured in
the last step (:class:`~raypipe.core.result.StageStats`): each layer keeps its
parameters and their gradients, and takes its share (by parameter count) of
its old stage's optimizer state and activations held for backward. These add
up when stages merge: a merged stage holds all of them.
"""
from __future__ import annotations

from collections.abc import Sequence

from raypipe.core.partition import partition_by_cost, stage_layer_ranges
from raypipe.core.result import StageStats


def layer_bytes(stage_layers: Sequence[Sequence[int]], parameter_bytes: Sequence[int],
                stats: Sequence[StageStats]) -> list[float]:
    """Each layer's predicted bytes: 2 x its parameter bytes (weights and gradients),
    plus its share of its stage's measured optimizer state and held activations.
    ``stage_layers``: each stage's layer indices (a worker's chunks: not contiguous)."""
    predicted = [0.0] * len(parameter_bytes)
    for layers, stage in zip(stage_layers, stats, strict=True):
        own = [parameter_bytes[index] for index in layers]
        shared = (stage.optimizer_bytes or 0) + stage.held_for_backward_bytes
        total = sum(own)
        for index, size in zip(layers, own):
            predicted[index] = 2 * size + (shared * size / total if total else shared / len(own))
    return predicted


def fewer_stages(costs: Sequence[float], predicted_bytes: Sequence[float], below: int, placeable: int,
                 capacity_bytes: float) -> list[int] | None:
    """The balance of the most stages, fewer than ``below`` and at most ``placeable``,
    whose every stage is predicted to fit ``capacity_bytes``; None when none fits."""
    for num_stages in range(min(below - 1, placeable, len(costs)), 0, -1):
        balance = partition_by_cost(costs, num_stages)
        if max(sum(predicted_bytes[index] for index in layers) for layers in stage_layer_ranges(balance)) \
                <= capacity_bytes:
            return balance
    return None
