"""Micro-batches of a global batch and their loss weights: the step's arithmetic."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MicroBatches:
    """One step's micro-batches for the first and last stages (views of the
    global batch, or the user's list), with each micro-batch's loss weight."""

    inputs: list
    targets: list
    weights: list[float]


def count_samples(targets: torch.Tensor) -> int:
    """Default loss count: the micro-batch's samples (its first dimension)."""
    return int(targets.shape[0])


def loss_weights(counts: list[int]) -> list[float]:
    """Weights that turn per-micro-batch mean losses into the exact global mean."""
    total = sum(counts)
    if total <= 0:
        raise ValueError(f"the global batch has no counted targets (counts per micro-batch: {counts})")
    return [count / total for count in counts]


def split_micro_batches(inputs: Any, targets: Any, count: int) -> tuple[list, list]:
    """Micro-batches by ``torch.tensor_split`` sizes, or as given (lists of tensors)."""
    if isinstance(inputs, (list, tuple)) or isinstance(targets, (list, tuple)):
        if len(inputs) != count or len(targets) != count:
            raise ValueError(f"got {len(inputs)} input and {len(targets)} target micro-batches; "
                             f"a step has {count} (num_micro_batches x num_replicas)")
        return list(inputs), list(targets)
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs have {inputs.shape[0]} samples but targets have {targets.shape[0]}")
    if inputs.shape[0] < count:
        raise ValueError(f"global batch of {inputs.shape[0]} samples is smaller than the step's {count} "
                         "micro-batches (num_micro_batches x num_replicas): every micro-batch needs at least "
                         "one sample")
    return list(torch.tensor_split(inputs, count)), list(torch.tensor_split(targets, count))


def replica_blocks(num_micro_batches: int, num_replicas: int) -> list[range]:
    """Each running replica's contiguous block of a step's ``num_micro_batches``,
    sized as ``torch.tensor_split`` sizes them (the first blocks one larger).

    A step's micro-batches and their loss weights do not depend on how many
    replicas run it, so the same step gives the same result (up to the order of
    the gradient sums) with fewer replicas, each running more micro-batches.
    """
    if not 1 <= num_replicas <= num_micro_batches:
        raise ValueError(f"{num_replicas} replica(s) cannot share a step of {num_micro_batches} micro-batch(es): "
                         "every replica needs at least one")
    base, extra = divmod(num_micro_batches, num_replicas)
    blocks, start = [], 0
    for replica in range(num_replicas):
        size = base + (1 if replica < extra else 0)
        blocks.append(range(start, start + size))
        start += size
    return blocks
