"""The replicas of one stage: they sum their gradients once per step and, with
ZeRO-1, share the parameters each of them stepped.

The workers holding the same stage in every replica form a subgroup of the
run's process group (:meth:`StageReplicas.join`, called by every member right
after joining the group). Gradients go in flat buckets of one dtype, every
bucket's collective in flight at once: an all-reduce onto every replica, or
(ZeRO-1) a reduce onto the replica that owns the bucket's parameters, which
later broadcasts their stepped values (:mod:`raypipe.stage.zero`). Without
replicas every method does nothing.
"""
from __future__ import annotations

from collections.abc import Callable
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
        None: all-reduce), or onto each gradient's owner only (ZeRO-1: a reduce per
        owner). :meth:`finish_gradient_reduction` writes the sums back. None without replicas."""
        if self._group is None:
            return None
        pending = []
        for owner, owned in self._by_owner(gradients, owners):
            for bucket in _buckets(owned):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                if owner is None:
                    work = dist.all_reduce(flat, group=self._group, async_op=True)
                else:
                    work = dist.reduce(flat, self.topology.rank(owner, self.stage), group=self._group,
                                       async_op=True)
                pending.append((work, flat, bucket if owner in (None, self.replica) else []))
        return pending

    def finish_gradient_reduction(self, pending: Any) -> None:
        """Wait for :meth:`start_gradient_reduction` and write back the sums this replica received."""
        for work, flat, bucket in pending or ():
            self._wait(work, "gradient reduction")
            _unflatten(flat, bucket)

    def gather_parameters(self, parameters: list[torch.Tensor], owners: Owners) -> None:
        """ZeRO-1, after the owners stepped: every replica gets every parameter's new
        value from its owner (a broadcast per owner and bucket; nothing unsharded)."""
        if self._group is None or owners is None:
            return
        pending = []
        for owner, owned in self._by_owner(parameters, owners):
            for bucket in _buckets(owned):
                flat = torch.cat([p.detach().reshape(-1) for p in bucket])
                work = dist.broadcast(flat, self.topology.rank(owner, self.stage), group=self._group,
                                      async_op=True)
                pending.append((work, flat, bucket if owner != self.replica else []))
        for work, flat, bucket in pending:
            self._wait(work, "parameter gather")
            with torch.no_grad():
                _unflatten(flat, bucket)

    def _by_owner(self, tensors: list[torch.Tensor], owners: Owners) -> list[tuple[int | None, list[torch.Tensor]]]:
        if owners is None:
            return [(None, tensors)]
        return [(owner, [t for t, o in zip(tensors, owners, strict=True) if o == owner])
                for owner in range(self.topology.num_replicas)]


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
