"""ZeRO-1 by parameter: which replica of a stage keeps a parameter's optimizer
state and steps it.

With ``shard_optimizer`` each trainable parameter of a stage has one owner among
the stage's ``d`` replicas (largest parameters first, each to the least loaded
replica: every replica computes the same assignment), as PyTorch's
``ZeroRedundancyOptimizer`` partitions: whole parameters, so the user's
optimizer factory sees real parameters (any optimizer, any param groups). A
replica builds its optimizer over the parameters it owns only, so it holds about
1/d of the optimizer state, and in bf16 it alone keeps their fp32 main weights
(:mod:`raypipe.stage.precision`). Each step the owner receives the summed
gradient of its parameters (a reduce-scatter, not an all-reduce), steps them,
and an all-gather gives the other replicas their new compute weights
(:mod:`raypipe.comm.replicas`). Without sharding every replica owns every
parameter. An elastic run's resize assigns the owners afresh over the replicas
running (see :mod:`raypipe.control.elastic`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ownership:
    """The owners of a stage's trainable parameters, seen from one replica."""

    replica: int
    owners: tuple[int, ...] | None  # per trainable parameter, in order; None: every replica owns every one

    @classmethod
    def assign(cls, parameters: list[torch.Tensor], num_replicas: int, replica: int,
               shard_optimizer: bool) -> Ownership:
        """Deterministic, balanced by element count (ties to the lower replica)."""
        if not shard_optimizer or num_replicas == 1:
            return cls(replica, None)
        loads, owners = [0] * num_replicas, [0] * len(parameters)
        for index in sorted(range(len(parameters)), key=lambda i: (-parameters[i].numel(), i)):
            owner = min(range(num_replicas), key=lambda r: (loads[r], r))
            owners[index] = owner
            loads[owner] += parameters[index].numel()
        return cls(replica, tuple(owners))

    @property
    def sharded(self) -> bool:
        return self.owners is not None

    def owned(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters this replica steps (all of them, unsharded)."""
        if self.owners is None:
            return list(parameters)
        return [p for p, owner in zip(parameters, self.owners, strict=True) if owner == self.replica]

    def counts_in_norm(self) -> bool:
        """Whether this replica's gradient norm adds to its stage's: every owner's
        (sharded), or one replica's (unsharded: all hold the same sum)."""
        return self.owners is not None or self.replica == 0
