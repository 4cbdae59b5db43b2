"""Which worker is which replica's which stage.

Workers are ranked replica-major: the stages of replica 0 first, then those of
replica 1, and so on (as torchtitan's ``ParallelDims`` names its mesh). A
replica's stages form one pipeline; the workers holding the same stage in
every replica form that stage's data-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from raypipe.core.validation import check_positive_int


class WorkerCoordinates(NamedTuple):
    """A worker's place in the topology."""

    replica: int
    stage: int


@dataclass(frozen=True)
class Topology:
    """``num_replicas`` copies of a ``num_stages``-stage pipeline."""

    num_stages: int
    num_replicas: int = 1

    def __post_init__(self) -> None:
        check_positive_int("num_stages", self.num_stages)
        check_positive_int("num_replicas", self.num_replicas)

    @property
    def world_size(self) -> int:
        """The number of workers."""
        return self.num_stages * self.num_replicas

    def rank(self, replica: int, stage: int) -> int:
        """The rank of ``stage`` of ``replica``."""
        self._check("replica", replica, self.num_replicas)
        self._check("stage", stage, self.num_stages)
        return replica * self.num_stages + stage

    def coordinates(self, rank: int) -> WorkerCoordinates:
        """The (replica, stage) of worker ``rank``."""
        self._check("rank", rank, self.world_size)
        return WorkerCoordinates(*divmod(rank, self.num_stages))

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one replica's stages, first stage first."""
        return [self.rank(replica, stage) for stage in range(self.num_stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every replica: its data-parallel group."""
        return [self.rank(replica, stage) for replica in range(self.num_replicas)]

    @staticmethod
    def _check(name: str, value: int, bound: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
            raise IndexError(f"{name} {value!r} is outside 0..{bound - 1}")
