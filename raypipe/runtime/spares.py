"""Warm spares: idle stage processes that take a failed worker's place.

Replacing a worker from its spec starts a process, imports torch and builds the
layers: about 5 s of a heal's 6 s on a CPU box, more with a CUDA context. A
:class:`SparePool` keeps ``spare_workers`` processes of the workers' own actor
class started and idle (torch imported, the device set up: the actor built with
no spec), each in one worker bundle of a placement group of its own, spread over
nodes (SPREAD, so one lost node does not take every spare). A heal takes a ready
spare (:meth:`SparePool.take`) and has it :meth:`~raypipe.stage.worker.StageWorker.become`
the failed worker's spec; it runs on in the spare's bundle, and a new spare starts
in the background in the failed worker's bundle (:meth:`SparePool.start_in`).
Spares only ever stand in for failed workers: they never add a replica.

With ``tensor_parallel`` t > 1 a stage's t workers share one bundle (one node: their
collectives stay on its interconnect), so a spare is a *group* of t idle processes in one
bundle holding t workers' resources: a whole node's worth is the spare. It takes the place
of a whole stage (each process becoming one tp_rank's spec), never of one rank, which
would sit on another node than its peers; ``spare_workers`` (a multiple of t) counts the
processes, so the pool keeps ``spare_workers / t`` spares.

Where every process runs is a *location*: a placement group and a bundle index.
The group and the pool trade locations at each take, so a worker may run in the
pool's placement group and a spare in a replica's; whoever owns a placement group
frees it (the pool its own and those it adopted, :meth:`SparePool.adopt`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypipe.runtime import cluster

logger = logging.getLogger("raypipe")

Location = tuple[Any, int]  # (placement group, bundle index): where one worker or spare runs

# A new spare's start (a process, torch's imports: seconds of CPU) waits this long after the heal that
# freed its bundle: on a node short of cores it would slow the heal's restore and the step redone
# (on 2 cores here, that step took 1.0 s instead of 0.35 s); a heal with a spare takes well under it.
REFILL_DELAY_S = 3.0


@dataclass
class Spare:
    """One idle process, or at tensor_parallel t > 1 a group of t in one bundle (a whole stage's place)."""

    number: int  # names it in a heal's report: "spare N" (counted over the pool's life)
    actors: tuple  # its processes, the one that becomes tp_rank 0 first
    location: Location
    started: list  # each process's first heartbeat's reference: all done once the spare is up

    @property
    def name(self) -> str:
        return f"spare {self.number}"


class SparePool:
    """``count`` spares, each ``size`` idle workers of ``actor_class`` (a stage's tensor_parallel)
    in one bundle holding ``size`` times a worker's ``bundle``; started at once and never waited for
    (a spare not up yet is simply not taken)."""

    def __init__(self, actor_class: Any, bundle: dict[str, float], count: int,
                 refill_delay_s: float = REFILL_DELAY_S, size: int = 1) -> None:
        self._actor_class, self._bundle, self.count, self.size = actor_class, dict(bundle), count, size
        self._spare_bundle = cluster.stage_bundle(self._bundle, size)  # one node holds a spare's processes
        self._refill_delay_s = refill_delay_s
        self._lock = threading.RLock()  # a delayed refill runs on a timer's thread
        self._timers: list[threading.Timer] = []
        self._spares: list[Spare] = []
        self._free: list[Location] = []  # bundles of the pool's placement groups where no one runs
        self._owned: list[Any] = []  # the placement groups the pool frees
        self._numbered = 0
        if count > 0:
            own = self._placement([self._spare_bundle] * count, "SPREAD")
            self._owned.append(own)
            self._free = [(own, index) for index in range(count)]
        self.refill()

    @property
    def spares(self) -> list[Spare]:
        """The idle spares, started or starting."""
        return list(self._spares)

    def up_count(self) -> int:
        """How many idle spares are started and alive now (a heal could take one)."""
        with self._lock:
            spares = list(self._spares)
        return sum(self._is_up(spare) is True for spare in spares)

    def wait_until_up(self, timeout_s: float) -> bool:
        """Wait until every one of the ``count`` spares is started and up (a delayed refill
        included); whether they are within ``timeout_s``. For tests and benchmarks."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.up_count() >= self.count:
                return True
            time.sleep(0.1)
        return False

    def take(self) -> Spare | None:
        """A spare that is up, out of the pool (its location the caller's now); None when none is.
        Spares found dead are dropped (their bundles kept for new ones; a group's live
        processes killed with it)."""
        with self._lock:
            return self._take()

    def _take(self) -> Spare | None:
        dead = []
        try:
            for spare in list(self._spares):
                up = self._is_up(spare)
                if up is None:
                    continue
                self._spares.remove(spare)
                if up:
                    return spare
                logger.warning("raypipe: %s died idle; starting another", spare.name)
                self._stop(spare)  # a group's other processes hold its bundle
                dead.append(spare.location)
            return None
        finally:
            self.start_in(dead)

    def start_in(self, locations: list[Location]) -> None:
        """Bundles freed by workers (a whole stage's, at tensor_parallel > 1) that spares replaced: new
        spares start there, in the background after ``refill_delay_s`` (see :data:`REFILL_DELAY_S`)."""
        if not locations:
            return
        with self._lock:
            self._free = list(locations) + self._free
            if self._refill_delay_s <= 0:
                self.refill()
                return
            timer = threading.Timer(self._refill_delay_s, self.refill)
            timer.daemon = True
            self._timers = [pending for pending in self._timers if pending.is_alive()] + [timer]
            timer.start()

    def refill(self) -> None:
        """Start spares until there are ``count``: in free bundles, else in a placement
        group of one bundle asked for now (placed wherever there is room, when there is)."""
        with self._lock:
            self._refill()

    def _refill(self) -> None:
        while len(self._spares) < self.count:
            if not self._free:
                extra = self._placement([self._spare_bundle], "PACK")
                self._owned.append(extra)
                self._free.append((extra, 0))
            self._spares.append(self._start(self._free.pop(0)))

    def adopt(self, placement: Any, free_bundles: list[int]) -> None:
        """A placement group its owner gave up while a spare or a worker still runs in it:
        the pool frees it at :meth:`shutdown`; its ``free_bundles`` may hold spares."""
        with self._lock:
            self._owned.append(placement)
            self._free += [(placement, index) for index in free_bundles]

    def forget(self, placements: list[Any]) -> None:
        """Those placement groups were freed by their owner: the spares and bundles in them are gone."""
        gone = set(placements)
        with self._lock:
            for spare in [spare for spare in self._spares if spare.location[0] in gone]:
                self._spares.remove(spare)
                self._stop(spare)
            self._free = [location for location in self._free if location[0] not in gone]

    def located_in(self, placement: Any) -> bool:
        """Whether a spare runs (or starts) in ``placement``."""
        return any(spare.location[0] == placement for spare in self._spares)

    def shutdown(self) -> None:
        """Kill every spare and free the pool's placement groups (idempotent). Workers that
        took a spare's place run in them: the group they serve goes first."""
        with self._lock:
            for timer in self._timers:
                timer.cancel()
            for spare in self._spares:
                self._stop(spare)
            self._spares, self._free, self._timers, self.count = [], [], [], 0
            self._release(self._owned)
            self._owned = []

    def _stop(self, spare: Spare) -> None:
        """Kill every process of ``spare``."""
        for actor in spare.actors:
            self._kill(actor)

    # -- Ray (replaced in the unit tests) --------------------------------------
    def _start(self, location: Location) -> Spare:
        placement, index = location
        strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index)
        options = self._actor_class.options(num_cpus=self._bundle["CPU"], num_gpus=self._bundle.get("GPU", 0),
                                            scheduling_strategy=strategy, max_restarts=0)
        actors = tuple(options.remote(None) for _ in range(self.size))  # each its worker's share of the bundle
        self._numbered += 1
        return Spare(self._numbered - 1, actors, location, [actor.heartbeat.remote() for actor in actors])

    @staticmethod
    def _is_up(spare: Spare) -> bool | None:
        """True: every process started and alive when last asked; False: one died; None: still starting."""
        done, _ = ray.wait(spare.started, num_returns=len(spare.started), timeout=0)
        try:
            ray.get(done)
        except ray.exceptions.RayError:
            return False
        return len(done) == len(spare.started) or None

    @staticmethod
    def _placement(bundles: list[dict[str, float]], strategy: str) -> Any:
        return placement_group(bundles, strategy=strategy)

    @staticmethod
    def _kill(actor: Any) -> None:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass

    @staticmethod
    def _release(placements: list[Any]) -> None:
        cluster.release(placements)
