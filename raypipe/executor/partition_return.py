"""A re-partitioned run's way back to the stages it was configured with.

When not even one whole pipeline could be placed, the trainer re-partitioned
the model onto fewer stages (:mod:`raypipe.planning.repartition`). That run
is slower per step and holds more per worker, so it goes back as soon as there
is room again, the way an elastic run grows:

- one placement group of the configured pipeline is asked for (pending: Ray
  places it, and an autoscaler adds nodes for it, while the run goes on);
- once it is placed, the configured pipeline's workers start beside the running
  ones while steps run (process start, imports, building the layers);
- at the first step boundary where they are all ready, they adopt every layer
  of the running workers (snapshotted then, sent worker to worker through the
  object store), and the trainer swaps the groups.

The new pipeline needs its room beside the running one until the swap: on a
cluster with no room to spare, that is the node an autoscaler adds.
"""
from __future__ import annotations

import logging
from typing import Any

import ray

from raypipe.runtime import cluster, spread
from raypipe.runtime.group import StageGroup
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")


class PartitionReturn:
    """The configured pipeline's workers (``specs``, one replica), asked for and started
    in the background; :meth:`poll` says when they can take over."""

    def __init__(self, actor_class: Any, specs: list[WorkerSpec], bundle: dict[str, float]) -> None:
        self._actor_class, self._specs, self._bundle = actor_class, list(specs), bundle
        self._group: StageGroup | None = None
        self._ready: list = []
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
                self._group = StageGroup(self._actor_class, self._specs, self._bundle, 0, [self._placement])
                self._ready = [actor.ready.remote() for actor in self._group.actors]
            return None
        done, _ = ray.wait(self._ready, num_returns=len(self._ready), timeout=0)
        return self._group if len(done) == len(self._ready) else None

    def take_over(self, running: list[Any]) -> StageGroup | None:
        """The ready group, its workers holding every layer of the ``running`` workers
        (snapshotted now, between steps); None when a worker of either failed: the new
        workers are dropped and asked for again (a failed running one heals at the next step)."""
        snapshots = [actor.snapshot.remote() for actor in running]
        try:
            self._group.wait_ready()
            ray.get([actor.adopt.remote(*snapshots) for actor in self._group.actors])
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
