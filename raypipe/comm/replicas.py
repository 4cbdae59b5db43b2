"""The replicas of one stage: they sum their gradients once per step and, with
ZeRO-1, share the parameters each of them stepped.

The workers holding the same stage (the same tensor-parallel shard of it) in every
replica form a subgroup of the run's process group (:meth:`StageReplicas.join`, called by every member right
after joining the group). The tensors of a collective are laid out flat per
dtype and by owner (:class:`_FlatBucket`; without ZeRO-1 one owner: every
replica), and the collectives run over chunks of about ``_BUCKET_BYTES`` of
those buckets, ``_CHUNKS_IN_FLIGHT`` at a time, so that their flat copies add a
few buckets to a worker's memory, never a second copy of its gradients:

* without ZeRO-1 the gradients are all-reduced;
* with ZeRO-1 (:mod:`raypipe.stage.zero`) each owner's segment is padded to the
  longest, a reduce-scatter leaves each owner the sum of its own gradients, and
  after the owners stepped an all-gather gives every replica every owner's new
  values.

Without replicas every method does nothing.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raypipe.core.topology import Topology

_BUCKET_BYTES = 25 * 2**20  # a collective's flat input is about this size
_CHUNKS_IN_FLIGHT = 2  # collectives in flight at once: overlap without copying everything at once

Owners = tuple[int, ...] | None  # per tensor, the replica that owns it; None: every replica
Pending = tuple[Any, Callable[[], None]]  # a collective in flight, and what to do with its result


class StageReplicas:
    """One worker's view of its stage's data-parallel subgroup."""

    def __init__(self, topology: Topology, replica: int, stage: int, wait: Callable[[Any, str], None],
                 tp_rank: int = 0) -> None:
        self.topology, self.replica, self.stage, self.tp_rank = topology, replica, stage, tp_rank
        self._wait = wait  # waits for a pending work, raising the transport's error on failure
        self._group: Any = None

    def join(self) -> None:
        """Create every (stage, tp_rank)'s subgroup (each member creates all, in the same order) and keep this one's."""
        topology = self.topology
        if topology.num_replicas == 1:
            return
        for stage in range(topology.num_stages):
            for tp_rank in range(topology.tensor_parallel):
                group = dist.new_group(topology.stage_ranks(stage, tp_rank))
                if (stage, tp_rank) == (self.stage, self.tp_rank):
                    self._group = group

    def leave(self) -> None:
        self._group = None

    def start_gradient_reduction(self, gradients: list[torch.Tensor], owners: Owners = None) -> Any:
        """Start summing ``gradients`` over the replicas: onto every replica (``owners``
        None: all-reduce), or onto each gradient's owner only (ZeRO-1: reduce-scatter).
        :meth:`finish_gradient_reduction` runs the rest and writes the sums back. None
        without replicas."""
        if self._group is None:
            return None
        buckets = _FlatBucket.of(gradients, owners, self.topology.num_replicas)
        chunks = self._all_reduce(buckets) if owners is None else self._reduce_scatter(buckets)
        return _InFlight(chunks, self._wait, "gradient reduction").start()

    def finish_gradient_reduction(self, pending: Any) -> None:
        """Wait for :meth:`start_gradient_reduction` and write back the sums this replica received."""
        if pending is not None:
            pending.finish()

    def gather_parameters(self, tensors: list[torch.Tensor], owners: Owners) -> None:
        """ZeRO-1, after the owners stepped: every replica gets the new value of every
        tensor from its owner (all-gather; nothing unsharded)."""
        if self._group is None or owners is None:
            return
        buckets = _FlatBucket.of(tensors, owners, self.topology.num_replicas)
        _InFlight(self._all_gather(buckets), self._wait, "parameter gather").start().finish()

    # -- the collectives, chunk by chunk (each issued when the generator is advanced) --
    def _all_reduce(self, buckets: list[_FlatBucket]) -> Iterator[Pending]:
        for bucket in buckets:
            for start, stop in bucket.chunks(1):
                flat = bucket.read(0, start, stop)
                yield (dist.all_reduce(flat, group=self._group, async_op=True),
                       lambda bucket=bucket, start=start, flat=flat: bucket.write(0, start, flat))

    def _reduce_scatter(self, buckets: list[_FlatBucket]) -> Iterator[Pending]:
        for bucket in buckets:
            for start, stop in bucket.chunks(self.topology.num_replicas):
                mine = bucket.new_empty(stop - start)
                every = torch.cat([bucket.read(owner, start, stop) for owner in range(len(bucket.by_owner))])
                yield (dist.reduce_scatter_single(mine, every, group=self._group, async_op=True),
                       lambda bucket=bucket, start=start, mine=mine: bucket.write(self.replica, start, mine))

    def _all_gather(self, buckets: list[_FlatBucket]) -> Iterator[Pending]:
        replicas = self.topology.num_replicas
        for bucket in buckets:
            for start, stop in bucket.chunks(replicas):
                every = bucket.new_empty((stop - start) * replicas)
                work = dist.all_gather_single(every, bucket.read(self.replica, start, stop), group=self._group,
                                              async_op=True)
                yield work, lambda bucket=bucket, start=start, every=every: self._write_others(bucket, start, every)

    def _write_others(self, bucket: _FlatBucket, start: int, every: torch.Tensor) -> None:
        for owner, chunk in enumerate(every.chunk(self.topology.num_replicas)):
            if owner != self.replica:
                bucket.write(owner, start, chunk)


class _InFlight:
    """Collectives issued from ``chunks``, at most ``_CHUNKS_IN_FLIGHT`` at a time."""

    def __init__(self, chunks: Iterator[Pending], wait: Callable[[Any, str], None], what: str) -> None:
        self._chunks, self._wait, self._what = chunks, wait, what
        self._in_flight: deque[Pending] = deque()

    def start(self) -> _InFlight:
        while len(self._in_flight) < _CHUNKS_IN_FLIGHT:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._in_flight.append(chunk)
        return self

    def finish(self) -> None:
        while self._in_flight:
            work, write_back = self._in_flight.popleft()
            self._wait(work, self._what)
            write_back()
            self.start()


@dataclass
class _FlatBucket:
    """Tensors of one dtype laid out flat by owner: owner ``r``'s tensors, concatenated,
    at ``[r * length, r * length + their size)``, each segment zero-padded to ``length``
    (a collective's segments are equal). Without owners: one segment, every tensor."""

    by_owner: list[list[torch.Tensor]]
    length: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor], owners: Owners, num_replicas: int) -> list[_FlatBucket]:
        count = 1 if owners is None else num_replicas
        owners = owners or (0,) * len(tensors)
        buckets = []
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            of_dtype = [(t, o) for t, o in zip(tensors, owners, strict=True) if t.dtype == dtype]
            by_owner = [[t for t, o in of_dtype if o == owner] for owner in range(count)]
            buckets.append(cls(by_owner, max(sum(t.numel() for t in owned) for owned in by_owner)))
        return buckets

    def chunks(self, segments: int) -> list[tuple[int, int]]:
        """Element ranges of each segment whose ``segments`` pieces make one collective's input."""
        like = self.new_empty(0)
        size = max(1, _BUCKET_BYTES // (like.element_size() * segments))
        return [(start, min(start + size, self.length)) for start in range(0, self.length, size)]

    def read(self, owner: int, start: int, stop: int) -> torch.Tensor:
        """A copy of elements ``[start, stop)`` of ``owner``'s segment (padding: zeros)."""
        pieces = [flat[a:b] for flat, a, b, _ in self._overlaps(owner, start, stop)]
        missing = stop - start - sum(piece.numel() for piece in pieces)
        return torch.cat([*pieces, self.new_empty(missing).zero_()])

    @torch.no_grad()
    def write(self, owner: int, start: int, values: torch.Tensor) -> None:
        """Write ``values`` into ``owner``'s tensors from element ``start`` (padding dropped)."""
        for flat, a, b, position in self._overlaps(owner, start, start + values.numel()):
            flat[a:b].copy_(values[position - start:position - start + b - a])

    def new_empty(self, numel: int) -> torch.Tensor:
        """A flat tensor of the bucket's dtype and device."""
        like = next(t for owned in self.by_owner for t in owned)
        return like.new_empty(numel)

    def _overlaps(self, owner: int, start: int, stop: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """Per tensor of ``owner`` overlapping ``[start, stop)`` of its segment: the tensor
        viewed flat, the overlap's first and end element in it, and its position in the segment."""
        offset = 0
        for tensor in self.by_owner[owner]:
            end = offset + tensor.numel()
            if offset < stop and start < end:
                first = max(start, offset)
                yield tensor.detach().view(-1), first - offset, min(stop, end) - offset, first
            offset = end
            if offset >= stop:
                break
