"""The partition of the model onto stages when the cluster changes under a run, and
the way back to the configured one.

When not even one whole pipeline can be placed (a one-replica run, or every
replica lost a worker, with no room for a replacement), the model goes on with
one replica on the most stages that can be placed and that the memory model says
fit (:func:`fewer_stages_that_fit`, over :mod:`raypipe.planning.repartition`); the
new workers adopt every layer of the old ones' newest snapshot and the steps since
are redone. Such a run is slower per step and holds more per worker, so it goes
back to the configured stages as soon as there is room for them
(:class:`PartitionReturn`), and an elastic run then grows its replicas again.

How many stages (counting the room the running workers free when they go, not
only the room free now) and when to go back are :mod:`raypipe.control.policy`'s
decisions, asked by the :class:`~raypipe.control.controller.Controller`, which
owns the layout and swaps the groups; this module measures the room and the
memory model's answer, and starts the configured pipeline's workers.

The way back goes the way an elastic run grows:

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from raypipe.config import PipelineConfig
from raypipe.control.snapshots import holding
from raypipe.control.view import Room
from raypipe.core.partition import worker_layers
from raypipe.errors import WorkersLost
from raypipe.models.layers import LayerSpec, layer_parameter_count
from raypipe.planning.balance import layer_step_flops
from raypipe.planning.repartition import fewer_stages, layer_bytes
from raypipe.runtime import cluster, spread
from raypipe.runtime.group import StageGroup, WorkerInfo
from raypipe.runtime.health import get_watched
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")


@dataclass(frozen=True)
class FewerStages:
    """The memory model's answer for a re-partition: each count of fewer stages whose
    stages fit a worker, with its balance; what the model is predicted to hold (bytes)
    and a worker's memory (bytes), for the error when none is placed."""

    balances: dict[int, list[int]]
    predicted_bytes: float
    capacity_bytes: float


def fewer_stages_that_fit(layers: Sequence[Any], reports: list | None, config: PipelineConfig,
                          balance: list[int], device_memory: int | None) -> FewerStages:
    """Each count of stages below ``config.num_stages`` whose stages the memory model says
    fit a worker (the running stages' ``reports`` measure what each layer holds, one rank's part
    of it at ``tensor_parallel`` t > 1, which a re-partition keeps; without them, 8 bytes per
    parameter, counted whole at any t: an over-estimate), and its balance."""
    costs = [layer_parameter_count(layer) for layer in layers]
    t = config.tensor_parallel  # reports in rank order, a stage's t ranks adjacent: each stage's tp_rank 0 measures
    stats = [report.stats for report in reports[:config.num_stages * t:t]] if reports else None
    running = worker_layers(balance, config.num_stages, config.placement)
    predicted = layer_bytes(running, [4 * cost for cost in costs], stats) if stats else [8.0 * cost for cost in costs]
    capacity = cluster.worker_memory_bytes(device_memory)
    balances = {}
    for count in range(1, min(config.num_stages, len(costs) + 1)):
        fitting = fewer_stages(costs, predicted, count + 1, count, capacity)
        if fitting is not None and len(fitting) == count:
            balances[count] = fitting
    return FewerStages(balances, sum(predicted), capacity)


def layer_step_costs(layers: Sequence[Any], config: PipelineConfig) -> list[float]:
    """Each layer's share of its stage's time, for a rebalance away from a slow worker
    (:func:`raypipe.control.stragglers.rebalance`): its flops in one step (its ``LayerCost``'s,
    with the recomputed forwards) where every layer has a cost, else its parameter count (what
    ``balance="parameters"`` splits by)."""
    costs = [layer.cost if isinstance(layer, LayerSpec) else None for layer in layers]
    if all(cost is not None for cost in costs):
        return [layer_step_flops(cost, config.activation_checkpoint, config.num_micro_batches) for cost in costs]
    return [float(layer_parameter_count(layer)) for layer in layers]


def room(bundle: dict[str, float], running: Sequence[WorkerInfo], tensor_parallel: int = 1) -> Room:
    """The room for stages of ``tensor_parallel`` workers of ``bundle`` each, a stage's on one node,
    now and once the ``running`` workers went (a stage's bundle each; a lost node's frees none)."""
    stage = cluster.stage_bundle(bundle, tensor_parallel)
    stages_on = [worker.node_id for worker in running if worker.tp_rank == 0]  # a stage's t workers share a node
    return Room(cluster.placeable_workers(stage), cluster.placeable_workers(stage, stages_on))


def fewer_stages_config(config: PipelineConfig, balance: list[int]) -> PipelineConfig:
    """The config of a re-partition to ``balance`` (layers per stage, one chunk each): a schedule of
    model chunks (interleaved_1f1b, zbv) becomes 1f1b, which runs on any number of stages with
    any number of micro-batches and holds no more than they do; the others stay."""
    chunked = config.virtual_stages > 1
    return config.replace(num_stages=len(balance), balance=balance,
                          **({"schedule": "1f1b", "virtual_stages": 1} if chunked else {}))


class PartitionReturn:
    """The configured pipeline's workers (``specs``, one replica), asked for and started
    in the background; :meth:`poll` says when they can take over."""

    def __init__(self, actor_class: Any, specs: list[WorkerSpec], bundle: dict[str, float]) -> None:
        self._actor_class, self._specs, self._bundle = actor_class, list(specs), bundle
        self._tensor_parallel = specs[0].config.tensor_parallel  # a stage's t workers share its bundle
        self._group: StageGroup | None = None
        self._ready: list = []
        self.in_place = True  # until a swap in place found the room gone
        self._ask()

    def _ask(self) -> None:
        self._placement = spread.replica_group([cluster.stage_bundle(self._bundle, self._tensor_parallel)]
                                               * self.num_stages)
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
        """The configured pipeline's stages (``tensor_parallel`` workers each)."""
        return len(self._specs) // self._tensor_parallel

    @property
    def started(self) -> bool:
        """Whether its workers were started beside the running ones (ready or not)."""
        return self._group is not None

    def room(self, running: list[WorkerInfo]) -> Room:
        """The room for its stages now, and once the ``running`` workers went (a stage's bundle each)."""
        return room(self._bundle, running, self._tensor_parallel)

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
            # both groups watched: a stopped worker is found hung in hang_timeout_s, not when gRPC gives up on it
            get_watched([actor.adopt.remote(*holding(snapshots, layers, spec.layer_indices, spec.tp_rank,
                                                     self._tensor_parallel))
                         for actor, spec in zip(self._group.actors, self._group.specs)],
                        list(running.actors) + list(self._group.actors), self._specs[0].config.hang_timeout_s)
        except (ray.exceptions.RayError, WorkersLost) as error:
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
