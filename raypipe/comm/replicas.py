"""The replicas of one stage: they sum their gradients once per step and, with
ZeRO-1, share the parameters each of them stepped.

The workers holding the same stage in every replica form a subgroup of the
run's process group (:meth:`StageReplicas.join`, called by every member right
after joining the group). Without ZeRO-1 the gradients are all-reduced in flat
buckets of one dtype, every bucket in flight at once. With ZeRO-1
(:mod:`raypipe.stage.zero`) the tensors are laid out flat by owner, each
owner's segment padded to the longest: one reduce-scatter leaves each owner
the sum of its own gradients, and after the owners stepped one all-gather gives
every replica every owner's new values. Without replicas every method does
nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raypipe.core.topology import Topology

_BUCKET_BYTES = 25 * 2**20  # gradients are reduced in flat buckets of about this size

Owners = tuple[int, ...] | None  # per tensor, the replica that owns it; None: every replica


class StageReplicas:
    """One worker's view of its stage's data-parallel subgroup."""

    def __init__(self, topology: Topology, replica: int, stage: int, wait: Callable[[Any, str], None]) -> None:
        self.topology, self.replica, self.stage = topology, replica, stage
        self._wait = wait  # waits for a pending work, raising the transport's error on failure
        self._group: Any = None

    def join(self) -> None:
        """Create every stage's subgroup (each member creates all, in the same order) and keep this one's."""
        if self.topology.num_replicas == 1:
            return
        for stage in range(self.topology.num_stages):
            group = dist.new_group(self.topology.stage_ranks(stage))
            if stage == self.stage:
                self._group = group

    def leave(self) -> None:
        self._group = None

    def start_gradient_reduction(self, gradients: list[torch.Tensor], owners: Owners = None) -> Any:
        """Start summing ``gradients`` over the replicas: onto every replica (``owners``
        None: all-reduce), or onto each gradient's owner only (ZeRO-1: a reduce-scatter
        per dtype). :meth:`finish_gradient_reduction` writes the sums back. None without replicas."""
        if self._group is None:
            return None
        if owners is None:
            pending = []
            for bucket in _buckets(gradients):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                pending.append((dist.all_reduce(flat, group=self._group, async_op=True), flat, bucket))
            return pending
        pending = []
        for layout in _OwnerLayout.of(gradients, owners, self.topology.num_replicas):
            mine = layout.new_empty(layout.length)
            work = dist.reduce_scatter_single(mine, layout.flat(), group=self._group, async_op=True)
            pending.append((work, mine, layout.by_owner[self.replica]))
        return pending

    def finish_gradient_reduction(self, pending: Any) -> None:
        """Wait for :meth:`start_gradient_reduction` and write back the sums this replica received."""
        for work, flat, tensors in pending or ():
            self._wait(work, "gradient reduction")
            _unflatten(flat, tensors)

    def gather_parameters(self, tensors: list[torch.Tensor], owners: Owners) -> None:
        """ZeRO-1, after the owners stepped: every replica gets the new value of every
        tensor from its owner (an all-gather per dtype; nothing unsharded)."""
        if self._group is None or owners is None:
            return
        pending = []
        for layout in _OwnerLayout.of(tensors, owners, self.topology.num_replicas):
            mine = layout.segment(self.replica)
            gathered = layout.new_empty(layout.length * self.topology.num_replicas)
            pending.append((dist.all_gather_single(gathered, mine, group=self._group, async_op=True), gathered,
                            layout))
        for work, gathered, layout in pending:
            self._wait(work, "parameter gather")
            with torch.no_grad():
                for owner, owned in enumerate(layout.by_owner):
                    if owner != self.replica:
                        _unflatten(gathered[owner * layout.length:(owner + 1) * layout.length], owned)


@dataclass
class _OwnerLayout:
    """Tensors of one dtype laid out flat by owner: owner ``r``'s tensors, concatenated,
    at ``[r * length, r * length + their size)``, each segment zero-padded to ``length``
    (the collectives need equal segments)."""

    by_owner: list[list[torch.Tensor]]
    length: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor], owners: tuple[int, ...], num_replicas: int) -> list[_OwnerLayout]:
        layouts = []
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            of_dtype = [(t, o) for t, o in zip(tensors, owners, strict=True) if t.dtype == dtype]
            by_owner = [[t for t, o in of_dtype if o == owner] for owner in range(num_replicas)]
            layouts.append(cls(by_owner, max(sum(t.numel() for t in owned) for owned in by_owner)))
        return layouts

    def segment(self, owner: int) -> torch.Tensor:
        """Owner ``owner``'s tensors, flat and padded."""
        owned = [t.detach().reshape(-1) for t in self.by_owner[owner]]
        padding = self.new_empty(self.length - sum(t.numel() for t in owned)).zero_()
        return torch.cat(owned + [padding])

    def new_empty(self, numel: int) -> torch.Tensor:
        """A flat tensor of the layout's dtype and device."""
        like = next(t for owned in self.by_owner for t in owned)
        return like.new_empty(numel)

    def flat(self) -> torch.Tensor:
        """Every owner's segment, in owner order."""
        return torch.cat([self.segment(owner) for owner in range(len(self.by_owner))])


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, about ``_BUCKET_BYTES`` per bucket."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or tensor.dtype != buckets[-1][0].dtype or size + nbytes > _BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
