"""Elastic runs: between ``min`` and ``max`` pipeline replicas, resized at step
boundaries without losing a step or changing the numbers.

A step always has ``num_micro_batches x max`` micro-batches with the same loss
weights; the replicas running split them into contiguous blocks
(:func:`~raypipe.core.micro_batches.replica_blocks`). So a run with fewer
replicas computes the same step (up to the order of the gradient sums), and a
resize needs no change to the data or the optimizer.

The :class:`Resizer` asks Ray's autoscaler for ``max`` replicas' bundles
(:class:`~raypipe.runtime.autoscaling.ResourceRequest`, withdrawn at shutdown or, for a
driver killed outright, by its guard),
keeps one placement group asked for per missing replica (pending: Ray places
it, and an autoscaler adds nodes for it, while the run goes on) and:

- **shrinks** when a failed worker cannot be replaced within
  ``replace_timeout_s``: its replica is dropped and the survivors take the new
  layout (:meth:`Resizer.shrink`, called while healing the failed step);
- **grows** when a pending placement group is placed (moved to a node no running
  replica uses where one has room: :func:`~raypipe.runtime.spread.relocate`): the
  new replica's workers start while steps run, and once they are ready, at a step
  boundary, each restores a snapshot of the same stage of a live replica (sent worker to worker
  through the object store) and every worker takes the new layout
  (:meth:`Resizer.poll`, :meth:`Resizer.admit`).

Whether to shrink (or raise below ``min``) and whether to admit a ready replica
are :mod:`raypipe.control.policy`'s decisions, asked by the controller; the
:class:`Resizer` carries them out.

With ZeRO-1 (``shard_optimizer``) a resize moves parameters to other owners
(:mod:`raypipe.stage.zero` assigns them over the replicas running): every
worker takes the new layout, builds its optimizer over the parameters it now
owns, and adopts its stage's state from snapshots of every replica of the old
layout (on a grow, taken at the step boundary; on a shrink, the snapshot the
heal rolls back to, whose lost replica's part the keeper holds off its node),
so no optimizer state is lost and none is kept twice.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import ray

from raypipe.config import PipelineConfig
from raypipe.core.micro_batches import replica_blocks
from raypipe.errors import PlacementError, WorkersLost
from raypipe.executor.base import Executor
from raypipe.runtime import cluster, spread
from raypipe.runtime.autoscaling import ResourceRequest
from raypipe.runtime.group import NewReplica
from raypipe.runtime.health import get_watched, wait_watched
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")

def replica_specs(stages: list[WorkerSpec], num_replicas: int, num_micro_batches: int) -> list[WorkerSpec]:
    """Every worker's spec, in rank order, when ``num_replicas`` replicas of ``stages``
    (one spec per stage, each held by its config's ``tensor_parallel`` workers) share a
    step of ``num_micro_batches``."""
    blocks = replica_blocks(num_micro_batches, num_replicas)
    # each (replica, stage) laid out once (its ops and their lowering), then given to its t ranks
    laid_out = [spec.for_layout(replica, num_replicas, blocks[replica])
                for replica in range(num_replicas) for spec in stages]
    return [replace(spec, tp_rank=tp_rank) for spec in laid_out for tp_rank in range(spec.config.tensor_parallel)]


class Resizer:
    """Keeps an elastic run's replicas between ``config.min_replicas`` and ``max_replicas``.

    ``pending``: the placement groups of the missing replicas, already asked for (None:
    ask for ``max - 1`` now, as a run back on its configured stages does). It carries
    out what the controller's scaling and failure policies decide; the controller then
    sets the topology, the datasets of new readers and the metrics.
    """

    def __init__(self, config: PipelineConfig, executor: Executor, stages: list[WorkerSpec],
                 bundle: dict[str, float], pending: list[Any] | None) -> None:
        self.config, self.executor, self.stages = config, executor, stages
        # a replica's placement group: a bundle of t workers' resources per stage (one node each)
        self._bundles = [cluster.stage_bundle(bundle, config.tensor_parallel)] * config.num_stages
        self._per_replica = config.num_stages * config.tensor_parallel  # workers a replica
        self._pending: list[tuple[Any, Any]] = []  # asked for, not placed yet
        if pending is None:
            self._ask_for(config.max_replicas - 1)
        else:
            self._pending = [(group, group.ready()) for group in pending]
        self._starting: NewReplica | None = None
        # an autoscaler adds nodes for the most replicas (and keeps them) while the run lasts
        self._request = ResourceRequest(self._bundles)
        self._request.request(config.max_replicas)

    def specs(self, num_replicas: int) -> list[WorkerSpec]:
        """Every worker's spec when ``num_replicas`` replicas run."""
        return replica_specs(self.stages, num_replicas, self.config.micro_batches_per_step)

    # -- shrink -------------------------------------------------------------
    @property
    def running(self) -> int:
        """The replicas running now."""
        return len(self.executor.group.actors) // self._per_replica

    def _replicas_of(self, ranks: tuple[int, ...]) -> set[int]:
        return {self.executor.group.spec(rank).replica for rank in ranks}

    def below_minimum(self, unplaced: tuple[int, ...]) -> PlacementError:
        """The error when dropping the replicas of workers ``unplaced`` would leave fewer than ``min``."""
        dropped = self._replicas_of(unplaced)
        left = self.running - len(dropped)
        return PlacementError(f"{len(dropped)} replica(s) lost workers that no node has room to replace: {left} "
                              f"would be left, fewer than the elastic minimum {self.config.min_replicas} "
                              f"(num_replicas={tuple(self.config.num_replicas)}); saved checkpoints are intact: "
                              "load_checkpoint resumes from the newest", unplaced)

    def shrink(self, dropped: frozenset[int]) -> list[int]:
        """Drop the replicas ``dropped`` (the policy's :class:`~raypipe.control.policy.Shrink`:
        those whose replacements found no room, leaving at least ``min``), re-number the
        rest and give the group their specs; returns the old ranks of the workers kept, in
        their new order. The workers take the layout in :meth:`Executor.relayout`."""
        group, running = self.executor.group, self.running
        kept = group.drop_replicas(set(dropped))
        group.set_specs(self.specs(running - len(dropped)))
        self._ask_for(len(dropped))
        logger.warning("raypipe: shrank from %d to %d replica(s): no room to replace replica(s) %s",
                       running, running - len(dropped), sorted(dropped))
        return kept

    # -- grow ---------------------------------------------------------------
    def poll(self) -> int:
        """At a step boundary, cheaply: start a replica whose placement group was placed;
        how many replicas are started and ready to be admitted (0 or 1)."""
        if self._starting is not None:
            done, _ = ray.wait(self._starting.ready, num_returns=len(self._starting.ready), timeout=0)
            return int(len(done) == len(self._starting.ready))
        if self._pending:
            waits = [ready for _, ready in self._pending]
            placed, _ = ray.wait(waits, num_returns=1, timeout=0)
            if placed:
                position = waits.index(placed[0])
                placement, _ = self._pending.pop(position)
                # placed where a running replica is while another node has room: go there instead
                running_nodes = {worker.node_id for worker in self.executor.group.workers}
                placement = spread.relocate(placement, self._bundles, running_nodes)
                new_layout = self.specs(self.running + 1)
                self._starting = self.executor.group.start_replica(placement, new_layout[-self._per_replica:])
        return 0

    def admit(self) -> list[int] | None:
        """The ready replica (see :meth:`poll`) joins: its workers take the state of a live
        replica and every worker the new layout; the new workers' ranks, or None when a
        worker failed before it joined (another replica is asked for)."""
        starting, self._starting = self._starting, None
        group = self.executor.group
        old = list(group.actors)
        sharded = self.config.shard_optimizer
        try:
            ray.get(starting.ready)
            # from here on the workers answer heartbeats: a stopped one is found hung (WorkersLost), not waited for
            watched = old + list(starting.actors)
            if sharded:  # every replica's state, before the new layout moves parameters to other owners
                snapshots = [actor.snapshot.remote() for actor in old]
                wait_watched(snapshots, watched, self.config.hang_timeout_s)
            else:  # each new worker restores the same (stage, tp_rank) of the first replica, worker to worker
                self._get_watched([actor.restore.remote(old[rank].snapshot.remote())
                                   for rank, actor in enumerate(starting.actors)], watched)
            # a lost one fails the grow, not the layout
            self._get_watched([actor.committed_steps.remote() for actor in old], watched)
        except (ray.exceptions.RayError, WorkersLost) as error:
            logger.warning("raypipe: a worker failed before the new replica joined (%s); asking for another "
                           "replica", str(error).strip().splitlines()[-1])
            starting.cancel()
            self._ask_for(1)
            return None
        group.admit(starting)
        group.set_specs(self.specs(self.running))
        try:
            self.executor.relayout(old)
            if sharded:  # ZeRO-1: every worker adopts its (stage, tp_rank)'s parts from every old replica
                per = self._per_replica
                self._get_watched([actor.adopt.remote(*snapshots[rank % per::per])
                                   for rank, actor in enumerate(group.actors)], group.actors)
        except (ray.exceptions.RayError, WorkersLost) as error:
            return self._undo_admit(old, snapshots if sharded else None, error)
        logger.warning("raypipe: grew from %d to %d replica(s)", self.running - 1, self.running)
        return list(range(len(old), len(group.actors)))

    def _undo_admit(self, old: list[Any], snapshots: list | None, error: BaseException) -> None:
        """A worker was lost while every worker took the grown layout: the new replica
        goes (asked for again) and the old workers take their layout back (with ZeRO-1
        their own state too: some may have adopted new parts). One of them lost raises
        Ray's error here (or :class:`~raypipe.errors.WorkersLost`, stopped), which the heal
        folds in (re-giving every worker its spec); old workers ``error`` already names lost
        go to the heal at once."""
        logger.warning("raypipe: a worker failed while the new replica joined (%s); undoing the grow and "
                       "asking for another replica", str(error).strip().splitlines()[-1])
        group = self.executor.group
        group.drop_replicas({self.running - 1})
        group.set_specs(self.specs(self.running))
        self._ask_for(1)
        # old workers already named lost (one held in the grown group's formation by a lost peer among
        # them: alive, its next call would queue behind that join until p2p_timeout_s) go to the heal as
        # they are, not into the old layout's group first; the old workers' ranks are the grown group's first
        lost = error.ranks if isinstance(error, WorkersLost) else {}
        held = {rank: why for rank, why in lost.items() if rank < len(old)}
        if held:
            raise WorkersLost(held) from error
        self.executor.relayout(old)
        if snapshots is not None:
            self._get_watched([actor.restore.remote(snapshot) for actor, snapshot in zip(old, snapshots)], old)
        return None

    def _get_watched(self, refs: list, actors: list[Any]) -> list:
        """``ray.get`` of calls to ``actors``, whose heartbeats are watched meanwhile: a stopped one
        raises :class:`~raypipe.errors.WorkersLost` within ``hang_timeout_s``, not when gRPC's
        keepalive gives up on its call, minutes later."""
        return get_watched(refs, actors, self.config.hang_timeout_s)

    def take_partition(self, config: PipelineConfig, stages: list[WorkerSpec]) -> None:
        """The running replicas' layers moved to other stages (a rebalance: ``config``'s balance, the
        same stages): new replicas are built from ``stages``; one already starting with the old
        layers is cancelled and asked for again."""
        self.config, self.stages = config, stages
        if self._starting is not None:
            self._starting.cancel()
            self._starting = None
            self._ask_for(1)

    # -- lifecycle ------------------------------------------------------------
    def _ask_for(self, count: int) -> None:
        for _ in range(count):
            group = spread.replica_group(self._bundles)  # plain: any node an autoscaler adds will do
            self._pending.append((group, group.ready()))

    def close(self) -> None:
        """Free the placement groups asked for and a replica still starting; withdraw
        the autoscaler request."""
        self._request.withdraw()
        if self._starting is not None:
            self._starting.cancel()
            self._starting = None
        cluster.release([group for group, _ in self._pending])
        self._pending = []
