"""A copy of the workers' snapshots off their nodes, so that a lost node does not
take its workers' snapshots with it.

A snapshot is a task result of its worker: small ones live in the driver, larger
ones in the object store of the worker's node, and a lost node loses those. When
workers run on nodes other than the driver's, a :class:`SnapshotKeeper` actor on
the driver's node (no CPU) copies each snapshot into the object store there
(owned by the keeper; spilled to disk under memory pressure like any object),
for the two newest snapshots. It costs the driver's node one copy of the
training state per snapshot kept, and the transfer of each snapshot to it;
:attr:`~raypipe.PipelineConfig.snapshot_every` spaces them out, and while the
keeper copies one the next waits (training does not), so that the one before
stays until a newer one is safe.

The keeper needs no GPU: a snapshot holds host tensors only (workers stage
their state in host memory, :mod:`raypipe.stage.host_copy`, and
:func:`~raypipe.comm.task_tensors.as_shipped_state` ships nothing else), so it
unpickles in a process without CUDA.
"""
from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raypipe.comm.task_tensors import as_shipped_state

KEPT_SNAPSHOTS = 2  # the newest, and the one before it (the newest may never complete)


class SnapshotKeeper:
    """Holds object-store copies of the newest snapshots, by step."""

    def __init__(self) -> None:
        self._kept: dict[int, list[Any]] = {}

    def keep(self, step: int, *snapshots: Any) -> None:
        """Copy one snapshot of every worker (Ray brought them here as arguments)."""
        self._kept[step] = [ray.put(as_shipped_state(snapshot)) for snapshot in snapshots]
        for old in sorted(self._kept)[:-KEPT_SNAPSHOTS]:
            del self._kept[old]

    def copies(self, step: int) -> list[list[Any]]:
        """The copies of ``step``'s snapshots, each wrapped in a list so that the
        caller gets references, not values (empty when none are kept)."""
        return [[ref] for ref in self._kept.get(step, [])]


def start_keeper() -> Any:
    """A keeper on this (the driver's) node."""
    here = ray.get_runtime_context().get_node_id()
    keeper = ray.remote(SnapshotKeeper).options(
        num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
    return keeper.remote()
