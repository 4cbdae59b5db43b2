"""A re-partitioned run's way back to the stages it was configured with.

When not even one whole pipeline could be placed, the controller re-partitioned
the model onto fewer stages (:mod:`raypipe.planning.repartition`). That run
is slower per step and holds more per worker, so it goes back as soon as there
is room again, the way an elastic run grows:

- one placement group of the configured pipeline is asked for (pending: Ray
  places it, and an autoscaler adds nodes for it, while the run goes on);
- once it is placed, the configured pipeline's workers start beside the running
  ones while steps run (process start, imports, building the layers);
- at the first step boundary where they are all ready, they adopt every layer
  of the running workers (snapshotted then, sent worker to worker through the
  object store; each fetches the snapshots that hold its layers), and the
  controller swaps the groups.

That needs room for the configured pipeline beside the running one: the nodes
an autoscaler adds for it. A cluster that cannot grow (a fixed-size one whose
lost node came back) never has it; there, once the configured pipeline fits in
the room there is plus the running workers' own, the controller swaps in place at
a step boundary: the running workers are snapshotted and stopped, and the
configured pipeline is placed, started and adopts the snapshot (the run waits
for its workers to start; no step is lost or redone). If the room went
elsewhere meanwhile, the fewer stages start again from the same snapshot, and
that run swaps only beside from then on.
"""
from __future__ import annotations

import logging
from typing import Any

import ray

from raypipe.control.policy import fits_only_in_place
from raypipe.control.view import Room
from raypipe.executor.snapshot import holding
from raypipe.runtime import cluster, spread
from raypipe.runtime.group import StageGroup, WorkerInfo
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")


class PartitionReturn:
    """The configured pipeline's workers (``specs``, one replica), asked for and started
    in the background; :meth:`poll` says when they can take over."""

    def __init__(self, actor_class: Any, specs: list[WorkerSpec], bundle: dict[str, float]) -> None:
        self._actor_class, self._specs, self._bundle = actor_class, list(specs), bundle
        self._group: StageGroup | None = None
        self._ready: list = []
        self.in_place = True  # until a swap in place found the room gone
        self._ask()

    def _ask(self) -> None:
        self._placement = spread.replica_group([self._bundle] * len(self._specs))
        self._placed = self._placement.ready()

    def poll(self) -> StageGroup | None:
        """At a step boundary, cheaply: start the workers once their placement group is
        placed; return their group once every one of them is built."""
        if self._group is None:
            placed, _ = ray.wait([self._placed], timeout=0)
            if placed:
                self._group = self._start()
                self._ready = [actor.ready.remote() for actor in self._group.actors]
            return None
        done, _ = ray.wait(self._ready, num_returns=len(self._ready), timeout=0)
        return self._group if len(done) == len(self._ready) else None

    def _start(self) -> StageGroup:
        """The workers, created in the placed placement group."""
        return StageGroup(self._actor_class, self._specs, self._bundle, 0, [self._placement])

    @property
    def num_stages(self) -> int:
        """The configured pipeline's stages (one worker each)."""
        return len(self._specs)

    @property
    def started(self) -> bool:
        """Whether its workers were started beside the running ones (ready or not)."""
        return self._group is not None

    def room(self, running: list[WorkerInfo]) -> Room:
        """The room for workers of its bundle now, and once the ``running`` workers went (a bundle each)."""
        return Room(cluster.placeable_workers(self._bundle),
                    cluster.placeable_workers(self._bundle, [worker.node_id for worker in running]))

    def fits_in_place(self, running: list[WorkerInfo]) -> bool:
        """Whether the configured pipeline, not started beside, fits only in the room there
        is plus that of the ``running`` workers (a bundle each;
        :func:`~raypipe.control.policy.fits_only_in_place`)."""
        return self.in_place and not self.started and fits_only_in_place(self.room(running), self.num_stages)

    def start_in_place(self, timeout_s: float) -> StageGroup | None:
        """Once the running workers went: the configured pipeline's group, its workers
        built, when its placement group is placed within ``timeout_s``; else None, and
        no swap in place is tried again."""
        placed, _ = ray.wait([self._placed], timeout=timeout_s)
        if not placed:
            self.in_place = False
            return None
        group = self._start()
        self._placement = None  # the group's now
        try:
            group.wait_ready()
        except BaseException:
            group.shutdown()
            raise
        return group

    def take_over(self, running: StageGroup) -> StageGroup | None:
        """The ready group, its workers holding every layer of the ``running`` group's
        workers (snapshotted now, between steps; each new worker fetches the snapshots
        that hold its layers); None when a worker of either failed: the new workers are
        dropped and asked for again (a failed running one heals at the next step)."""
        snapshots = [actor.snapshot.remote() for actor in running.actors]
        layers = [spec.layer_indices for spec in running.specs]
        try:
            self._group.wait_ready()
            ray.get([actor.adopt.remote(*holding(snapshots, layers, spec.layer_indices))
                     for actor, spec in zip(self._group.actors, self._group.specs)])
        except ray.exceptions.RayError as error:
            logger.warning("raypipe: a worker failed while the configured pipeline took over (%s); asking for "
                           "it again", str(error).strip().splitlines()[-1])
            self.close()
            self._ask()
            return None
        group, self._group, self._ready, self._placement = self._group, None, [], None
        return group  # its placement group with it

    def close(self) -> None:
        """Kill the workers started and free the placement group asked for."""
        if self._group is not None:
            self._group.shutdown()  # frees the placement group too
            self._group, self._ready = None, []
        elif self._placement is not None:
            cluster.release([self._placement])
