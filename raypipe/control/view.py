"""What a layout decision needs to know, as frozen data (no Ray, no I/O).

The controller (:mod:`raypipe.control.controller`) gathers these facts from the
running workers, its snapshots and the cluster, and :mod:`raypipe.control.policy`
decides from them alone, so every decision can be tested on a fabricated view.
"""
from __future__ import annotations

from dataclasses import dataclass

from raypipe.core.topology import Topology


def repartitioned(num_stages: int, configured_stages: int | None) -> bool:
    """Whether a run on ``num_stages`` stages is on other stages than the ``configured_stages``
    (None: the configured ones), the one definition of a re-partitioned run."""
    return configured_stages is not None and configured_stages != num_stages


@dataclass(frozen=True)
class SnapshotView:
    """One in-memory snapshot of every worker (taken at the start of step ``step``)."""

    step: int
    whole: bool | None = True  # stored by every worker and, with a keeper, copied off their nodes; None until known
    kept_off_node: bool = False  # a keeper copies it off the workers' nodes (it outlives a lost node)
    lost: bool = False  # a heal tried it and neither the workers' copy nor the keeper's loaded


@dataclass(frozen=True)
class Room:
    """Workers of one bundle the live nodes have room for (each within one node)."""

    now: int  # free now
    with_running_gone: int  # once the running workers go, each freeing its bundle


@dataclass(frozen=True)
class FailedWorker:
    """A worker a failure event took: its rank, (replica, stage) and why, as the error named it."""

    rank: int
    replica: int
    stage: int
    why: str


@dataclass(frozen=True)
class LayoutView:
    """The running layout and a heal's progress, as a failure or scaling decision sees them.

    Ranks are ``replica * num_stages + stage`` of the layout in force. Fields a
    decision point has not learnt yet keep their defaults (``survivors_ended_step``
    None: the survivors were not asked; ``replaced`` False: no replacement placed)."""

    # the layout in force and the configured one
    num_stages: int
    replicas: int  # running now
    tensor_parallel: int = 1  # workers per stage (its tensor-parallel ranks)
    configured_stages: int | None = None  # None: the same as num_stages (not re-partitioned)
    min_replicas: int = 1
    max_replicas: int = 1
    elastic: bool = False  # a Resizer keeps the replicas between min and max
    shard_optimizer: bool = False  # ZeRO-1: the replicas of a stage hold different optimizer parts
    # the failure being healed
    failed: tuple[FailedWorker, ...] = ()
    failures: int = 0  # failure events so far, this one included
    max_failures: int | None = 3
    survivors_ended_step: frozenset[int] | None = None  # survivors (ranks) whose state ended the failed step
    unplaced: tuple[int, ...] = ()  # failed workers whose replacement found no room within replace_timeout_s
    replaced: bool = False  # the failed workers' replacements run (or a shrink dropped them): state comes next
    shrunk: bool = False  # this heal dropped replicas (ZeRO-1 then moves optimizer parts: a reshard)
    spares_up: int = 0  # warm spares started and alive (at tensor_parallel > 1, each a group of t: a stage's place)
    # what a heal can restore from
    snapshot_every: int = 1
    snapshots: tuple[SnapshotView, ...] = ()  # the newest last
    checkpoint_step: int | None = None  # the newest checkpoint saved or loaded whose steps since are logged
    checkpoint_lost: bool = False  # a heal tried it (and any older one kept) and none loaded
    # re-partitioning: the memory model's answer and the room
    can_repartition: bool = False  # a trainer that can start the model on fewer stages
    stage_counts_that_fit: tuple[int, ...] = ()  # counts below num_stages whose stages fit a worker's memory
    room: Room | None = None  # None: not measured
    waited_for_room_s: float = 0.0
    placement_timeout_s: float = 60.0
    # scaling
    new_replicas_ready: int = 0  # replicas started beside (asked for, placed, built), ready to be admitted
    configured_ready_beside: bool = False  # a re-partitioned run's configured pipeline is built beside it
    configured_started_beside: bool = False  # ... its workers were started beside (ready or not)
    return_in_place_allowed: bool = True  # a swap in place was not found impossible before

    @property
    def repartitioned(self) -> bool:
        """Whether the run is on other stages than configured."""
        return repartitioned(self.num_stages, self.configured_stages)

    @property
    def topology(self) -> Topology:
        """The ranks of the layout in force."""
        return Topology(self.num_stages, self.replicas, self.tensor_parallel)

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(worker.rank for worker in self.failed))

    @property
    def survivors(self) -> tuple[int, ...]:
        """Every worker of the layout in force that did not fail, by rank."""
        failed = set(self.failed_ranks)
        return tuple(rank for rank in range(self.topology.world_size) if rank not in failed)

    def replicas_of(self, ranks: tuple[int, ...]) -> frozenset[int]:
        """The replicas the workers ``ranks`` belong to."""
        return frozenset(self.topology.coordinates(rank).replica for rank in ranks)


__all__ = ["FailedWorker", "LayoutView", "Room", "SnapshotView", "repartitioned"]
