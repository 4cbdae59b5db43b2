"""A stage's layers run on one micro-batch: each layer seeded from (seed, step, micro-batch,
layer), so a recompute replays the same dropout masks whatever the partition, the number of
replicas or the activation-checkpoint mode; optionally in segments that
``torch.utils.checkpoint`` recomputes in the backward."""
from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

import torch
from torch import nn

from raypipe.core.seeding import derive_seed
from raypipe.stage.boundary import Boundary


def layer_seeds(seed: int, step: int, global_micro_batch: int, layer_indices: Sequence[int]) -> list[int]:
    """Each layer's seed for one micro-batch (its index in the whole step, not in a replica's block)."""
    return [derive_seed(seed, step, global_micro_batch, index) for index in layer_indices]


def run_layers(layers: nn.ModuleList, weights: object, hidden: Boundary, seeds: Sequence[int],
               device: torch.device, segment_size: int | None = None, positions: range | None = None) -> Boundary:
    """``layers`` (those at ``positions``, a model chunk's; None: all) on ``hidden`` through
    ``weights.run`` (see :mod:`raypipe.stage.precision`), the i-th of them seeded with ``seeds[i]``;
    with ``segment_size``, in checkpointed segments of that many layers."""
    positions = range(len(layers)) if positions is None else positions

    def run(run_positions: range, hidden: Boundary) -> Boundary:
        # the modules walked, not indexed: ModuleList's indexing costs microseconds a layer (a str key, two len())
        for position, layer in zip(run_positions, islice(layers, run_positions.start, run_positions.stop), strict=True):
            seed = seeds[position - positions.start]
            torch.default_generator.manual_seed(seed)  # ~1 us; torch.manual_seed costs ~80 us
            if device.type == "cuda":
                torch.cuda.default_generators[device.index].manual_seed(seed)
            hidden = weights.run(position, layer, hidden)
        return hidden

    if not segment_size:
        return run(positions, hidden)
    from torch.utils.checkpoint import checkpoint

    for start in range(positions.start, positions.stop, segment_size):
        hidden = checkpoint(run, range(start, min(start + segment_size, positions.stop)), hidden, use_reentrant=False)
    return hidden
