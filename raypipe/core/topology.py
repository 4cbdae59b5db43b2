"""Which worker is which replica's which stage, and which of the stage's tensor-parallel ranks.

A worker is (replica, stage, tp_rank). Ranks are ordered replica-major, then
stage, then tp_rank: ``rank = (replica * num_stages + stage) * tensor_parallel +
tp_rank``, so the ``tensor_parallel`` workers of one stage are adjacent (on one
node, inside its fast interconnect), as torchtitan's ``ParallelDims`` orders
its mesh with TP innermost. Three kinds of group follow:

* a replica's pipeline per tp_rank: tp_rank i of stage s talks to tp_rank i of
  stage s + 1 (:meth:`Topology.pipeline_ranks`);
* a stage's data-parallel group per (stage, tp_rank): the workers holding the
  same shard of the same stage in every replica (:meth:`Topology.stage_ranks`);
* a stage's tensor-parallel group: its ``tensor_parallel`` workers in one
  replica (:meth:`Topology.tensor_ranks`).

With ``tensor_parallel=1`` a rank is ``replica * num_stages + stage``. This is
the one place that does the rank arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from raypipe.core.validation import check_positive_int


class WorkerCoordinates(NamedTuple):
    """A worker's place in the topology."""

    replica: int
    stage: int
    tp_rank: int = 0


@dataclass(frozen=True)
class Topology:
    """``num_replicas`` copies of a ``num_stages``-stage pipeline, each stage held by
    ``tensor_parallel`` workers."""

    num_stages: int
    num_replicas: int = 1
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        check_positive_int("num_stages", self.num_stages)
        check_positive_int("num_replicas", self.num_replicas)
        check_positive_int("tensor_parallel", self.tensor_parallel)

    @property
    def world_size(self) -> int:
        """The number of workers."""
        return self.num_replicas * self.num_stages * self.tensor_parallel

    @classmethod
    def of_workers(cls, num_stages: int, num_workers: int, tensor_parallel: int = 1) -> Topology:
        """The ranks of a group of ``num_workers`` workers, ``tensor_parallel`` a stage: as many
        replicas as they make (a group resized before the layout in force counts its own)."""
        return cls(num_stages, num_workers // (num_stages * tensor_parallel), tensor_parallel)

    def rank(self, replica: int, stage: int, tp_rank: int = 0) -> int:
        """The rank of tensor-parallel rank ``tp_rank`` of ``stage`` of ``replica``."""
        self._check("replica", replica, self.num_replicas)
        self._check("stage", stage, self.num_stages)
        self._check("tp_rank", tp_rank, self.tensor_parallel)
        return (replica * self.num_stages + stage) * self.tensor_parallel + tp_rank

    def coordinates(self, rank: int) -> WorkerCoordinates:
        """The (replica, stage, tp_rank) of worker ``rank``."""
        self._check("rank", rank, self.world_size)
        stage_worker, tp_rank = divmod(rank, self.tensor_parallel)
        return WorkerCoordinates(*divmod(stage_worker, self.num_stages), tp_rank)

    def place(self, rank: int) -> tuple[int, ...]:
        """Worker ``rank``'s place as failures name it: (replica, stage), and (replica, stage,
        tp_rank) with tensor parallelism (:func:`raypipe.errors.place_name`)."""
        coordinates = self.coordinates(rank)
        return tuple(coordinates) if self.tensor_parallel > 1 else tuple(coordinates)[:2]

    def pipeline_ranks(self, replica: int, tp_rank: int = 0) -> list[int]:
        """The ranks of one replica's stages at ``tp_rank``, first stage first: the
        workers that pass activations to each other."""
        return [self.rank(replica, stage, tp_rank) for stage in range(self.num_stages)]

    def stage_ranks(self, stage: int, tp_rank: int = 0) -> list[int]:
        """The ranks holding ``tp_rank``'s shard of ``stage`` in every replica: its
        data-parallel group."""
        return [self.rank(replica, stage, tp_rank) for replica in range(self.num_replicas)]

    def tensor_ranks(self, replica: int, stage: int) -> list[int]:
        """The ranks holding ``stage`` of ``replica``, tp_rank 0 first: its tensor-parallel group."""
        first = self.rank(replica, stage)
        return list(range(first, first + self.tensor_parallel))

    @staticmethod
    def _check(name: str, value: int, bound: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
            raise IndexError(f"{name} {value!r} is outside 0..{bound - 1}")
