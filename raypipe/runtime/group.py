"""StageGroup: the stage workers of a run, as one thing with a lifecycle.

It creates the workers from frozen :class:`~raypipe.stage.spec.WorkerSpec`s,
each pinned to its bundle of one placement group, waits for them with a
timeout, polls their health, replaces one from its spec, and shuts all down
(modelled on Ray Train v2's ``WorkerGroup``). What the workers compute is not
its business: executors drive them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypipe.errors import PlacementError, RaypipeError
from raypipe.runtime import cluster
from raypipe.runtime.spares import Location, SparePool
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")


@dataclass(frozen=True)
class WorkerInfo:
    """Where one live worker runs; ``tp_rank`` is its place among its stage's tensor-parallel workers."""

    replica: int
    stage: int
    node_id: str
    pid: int
    tp_rank: int = 0


@dataclass
class NewReplica:
    """A replica's workers started in its own placement group, not yet in the group."""

    placement: Any
    specs: list[WorkerSpec]
    actors: list[Any]
    ready: list  # each worker's ready() reference

    def cancel(self) -> None:
        """Kill its workers and free its placement group."""
        for actor in self.actors:
            _kill(actor)
        cluster.release([self.placement])


class StageGroup:
    """Workers of ``actor_class``, one per spec; each replica's in its own PACK
    placement group (bundle = stage), until a warm spare takes a failed worker's
    place: that worker then runs in the spare's bundle (see :mod:`raypipe.runtime.spares`).
    A stage's ``tensor_parallel`` workers always share one bundle: at t > 1 a spare (a group
    of t) takes only the place of a whole stage."""

    def __init__(self, actor_class: Any, specs: list[WorkerSpec], bundle: dict[str, float],
                 placement_timeout_s: float, placements: list[Any] | None = None,
                 spares: SparePool | None = None) -> None:
        """``placements``: one placement group per replica, already placed (else reserved here).
        ``spares``: the warm spares replacements come from first; None: the group starts the
        config's ``spare_workers`` itself (and stops them at :meth:`shutdown`)."""
        self._actor_class, self._specs, self._bundle = actor_class, list(specs), bundle
        num_replicas = 1 + max(spec.replica for spec in specs)
        stage = cluster.stage_bundle(bundle, specs[0].config.tensor_parallel)  # a stage's t workers share its bundle
        self._placements = placements or cluster.reserve(num_replicas, [stage] * specs[0].num_stages,
                                                         placement_timeout_s)
        # where each worker runs: its replica's bundle of its stage, or a spare's bundle it took
        self._where: list[Location] = [(self._placements[spec.replica], spec.bundle_index) for spec in specs]
        self.actors: list[Any] = [self.start_worker(index) for index in range(len(specs))]
        self._owns_spares = spares is None
        tensor_parallel = self._tensor_parallel = specs[0].config.tensor_parallel
        # spare_workers counts processes: at t > 1 a multiple of t, each spare a group of t (a stage's place)
        self.spares = spares if spares is not None else SparePool(
            actor_class, bundle, specs[0].config.spare_workers // tensor_parallel, size=tensor_parallel)
        self._ready: list[dict[str, Any]] = []

    def wait_ready(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait until every worker is built; returns what each ``ready()`` reported.

        A worker that fails to build raises its error; one that is not ready in
        ``timeout_s`` raises :class:`RaypipeError`.
        """
        refs = [actor.ready.remote() for actor in self.actors]
        try:
            self._ready = ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RaypipeError(f"stage workers were not ready within {timeout_s:g}s") from None
        return self._ready

    @property
    def workers(self) -> list[WorkerInfo]:
        """The live workers, in (replica, stage, tp_rank) order."""
        return sorted((WorkerInfo(spec.replica, spec.stage, info["node_id"], info["pid"], spec.tp_rank)
                       for spec, info in zip(self._specs, self._ready)),
                      key=lambda worker: (worker.replica, worker.stage, worker.tp_rank))

    def poll(self, timeout_s: float = 5.0) -> list[int]:
        """Indices of workers that are dead or do not answer within ``timeout_s``."""
        pings = {actor.ready.remote(): index for index, actor in enumerate(self.actors)}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
        unhealthy = {index for ref, index in pings.items() if ref not in answered}
        for ref in answered:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                unhealthy.add(pings[ref])
        return sorted(unhealthy)

    def kill(self, indices: list[int]) -> None:
        """Kill workers ``indices`` now (a stopped or wedged process too)."""
        for index in indices:
            _kill(self.actors[index])

    def replace(self, indices: list[int], timeout_s: float | None = None) -> dict[int, str]:
        """Kill workers ``indices`` (those still alive) and put new ones built from their
        specs in their place: a warm spare where one is up (it runs on in its bundle,
        and a new spare starts in the freed one), else a new process in the same
        bundle. At tensor_parallel t > 1 a spare (t processes, one bundle) takes only a
        stage all of whose t workers are in ``indices``, each process one tp_rank's spec;
        the workers of a stage partly replaced are new processes in its bundle. Waits until
        all are ready, or raises :class:`PlacementError` after ``timeout_s`` (e.g. no node
        has room for a bundle whose node was lost). Returns which spare took each place
        (index: "spare N"), if any did."""
        self.kill(indices)
        pings, taken, freed = {}, {}, []
        for stage in self._stages_of(indices):
            spare = self.spares.take() if len(stage) == self._tensor_parallel else None
            if spare is None:
                for index in stage:
                    self.actors[index] = self.start_worker(index)
                    pings[self.actors[index].ready.remote()] = index
                continue
            freed.append(self._where[stage[0]])  # the stage's bundle: its workers share it
            for index, actor in zip(stage, spare.actors, strict=True):
                self._where[index], self.actors[index], taken[index] = spare.location, actor, spare.name
                pings[actor.become.remote(self._specs[index])] = index
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pings:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=left)
            if not answered:
                break
            for ref in answered:
                index = pings.pop(ref)
                try:
                    self._ready[index] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    if index not in taken:
                        raise
                    # the spare died before it became the worker (e.g. with its node): a new process in its bundle
                    logger.warning("raypipe: %s died taking a failed worker's place; starting a new process",
                                   taken.pop(index))
                    self.actors[index] = self.start_worker(index)
                    pings[self.actors[index].ready.remote()] = index
        self.spares.start_in(freed)  # after the heal's critical path: the new spares start in the background
        unplaced = sorted(pings.values())
        if unplaced:
            where = ", ".join(f"replica {self._specs[i].replica} stage {self._specs[i].stage}" for i in unplaced)
            raise PlacementError(f"could not place a replacement for {where} within {timeout_s:g}s "
                                 f"(replace_timeout_s): the cluster has {cluster.describe_available()} available",
                                 tuple(unplaced))
        return taken

    def _stages_of(self, indices: list[int]) -> list[list[int]]:
        """``indices`` by stage (its workers in tp_rank order), stages in rank order: a stage's
        ``tensor_parallel`` workers are adjacent ranks."""
        stages: dict[int, list[int]] = {}
        for index in sorted(indices):
            stages.setdefault(index // self._tensor_parallel, []).append(index)
        return list(stages.values())

    def _bundles(self, indices: list[int]) -> list[Location]:
        """The distinct locations of workers ``indices`` (a stage's workers share one), in order."""
        return list(dict.fromkeys(self._where[index] for index in indices))

    def index_of(self, error: ray.exceptions.RayActorError) -> int | None:
        """Which worker a Ray actor error is about, if any of ours."""
        actor_id = getattr(error, "actor_id", None)
        for index, info in enumerate(self._ready):
            if actor_id is not None and info.get("actor_id") == actor_id:
                return index
        return None

    def spec(self, index: int) -> WorkerSpec:
        """The spec worker ``index`` was built from."""
        return self._specs[index]

    @property
    def specs(self) -> list[WorkerSpec]:
        """Every worker's spec, in rank order."""
        return list(self._specs)

    def drop_replicas(self, replicas: set[int]) -> list[int]:
        """Kill every worker of ``replicas`` and free their placement groups; the
        others keep their order. Returns the old ranks of the workers kept. Their
        specs still hold the old layout until :meth:`set_specs`."""
        kept = [index for index, spec in enumerate(self._specs) if spec.replica not in replicas]
        dropped = [index for index in range(len(self._specs)) if index not in kept]
        self.kill(dropped)
        self._give_up([self._placements[replica] for replica in sorted(replicas)], kept, dropped)
        self._placements = [group for replica, group in enumerate(self._placements) if replica not in replicas]
        self._where = [self._where[index] for index in kept]
        self.actors = [self.actors[index] for index in kept]
        self._specs = [self._specs[index] for index in kept]
        self._ready = [self._ready[index] for index in kept]
        return kept

    def set_specs(self, specs: list[WorkerSpec]) -> None:
        """The workers' specs after a resize (a replacement is built from these)."""
        if [spec.stage for spec in specs] != [spec.stage for spec in self._specs]:
            raise ValueError("a new layout keeps every worker's stage")
        self._specs = list(specs)

    def start_replica(self, placement: Any, specs: list[WorkerSpec]) -> NewReplica:
        """Start a replica's workers in ``placement`` (placed); :meth:`admit` adds it once ready."""
        actors = [self._create_in(placement, spec) for spec in specs]
        return NewReplica(placement, list(specs), actors, [actor.ready.remote() for actor in actors])

    def _give_up(self, placements: list[Any], kept: list[int], dropped: list[int]) -> None:
        """Free the placement groups of dropped replicas, except one where a kept worker or a
        spare still runs (a spare took its place, or started in a freed bundle): the pool
        adopts that one. The dropped workers' bundles elsewhere may hold new spares."""
        for group in placements:
            if any(self._where[index][0] == group for index in kept) or self.spares.located_in(group):
                free = [where[1] for where in self._bundles(dropped) if where[0] == group]
                self.spares.adopt(group, free)
            else:
                cluster.release([group])
        self.spares.start_in([where for where in self._bundles(dropped) if where[0] not in placements])

    def admit(self, replica: NewReplica) -> None:
        """Make a started replica (whose workers are ready) the group's last."""
        self._where += [(replica.placement, spec.bundle_index) for spec in replica.specs]
        self._placements.append(replica.placement)
        self.actors += replica.actors
        self._specs += replica.specs
        self._ready += ray.get(replica.ready)

    def shutdown(self) -> None:
        """Kill every worker and free the placement group (idempotent)."""
        for actor in self.actors:
            _kill(actor)
        self.actors = []
        if self._owns_spares:
            self.spares.shutdown()
        else:  # a pool that outlives this group: spares it started in our bundles go with them, and
            # the bundles of its own where our workers ran (having taken a spare's place) are its again
            self.spares.forget(self._placements)
            self.spares.start_in([where for where in self._bundles(list(range(len(self._where))))
                                  if where[0] not in self._placements])
        cluster.release(self._placements)
        self._placements = []

    def start_worker(self, index: int) -> Any:
        """A new process for worker ``index`` (its spec) in its bundle, not waited for: what starting
        the group and a replacement run for each worker (where a fault can be injected as one starts:
        benchmarks/bench_compound_faults.py kills one before it is ready)."""
        placement, bundle_index = self._where[index]
        return self._create_in(placement, self._specs[index], bundle_index)

    def _create_in(self, placement: Any, spec: WorkerSpec, bundle_index: int | None = None) -> Any:
        bundle_index = spec.bundle_index if bundle_index is None else bundle_index
        strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle_index)
        options = {"num_cpus": self._bundle["CPU"], "num_gpus": self._bundle.get("GPU", 0),
                   "scheduling_strategy": strategy, "max_restarts": 0}
        return self._actor_class.options(**options).remote(spec)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - already dead is fine
        pass
