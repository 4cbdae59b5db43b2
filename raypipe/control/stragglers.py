"""Slow workers: found from each worker's own compute per step, a pure decision over a frozen view.

At scale the common fault is a slow worker, not a dead one (a throttling GPU, a noisy
neighbour): a pipeline runs at its slowest stage's pace, and every replica waits for it at
the gradient reduction. A worker's *own compute* in a step is the time of its compute ops
(F, B, I, W) from its timeline, not the step's wall time: receives, the step gate and the
reduction are waiting, and a worker that waits for a slow neighbour is not slow itself.
With tensor parallelism a rank also waits for a slow peer *inside* its F and B, in the
stage's collectives: each op then carries the host's time in them
(:attr:`~raypipe.core.result.OpEvent.collective_wait`, :mod:`raypipe.stage.collective_wait`),
and its own compute is its time less that wait. That is measured on CPU (the host blocks in
a gloo collective until every rank has arrived) at one step in ``COLLECTIVE_WAIT_EVERY`` (10;
:mod:`raypipe.stage.stage_op`), and only those steps are recorded: at t > 1 on CPU
``slow_steps`` counts measured steps. On CUDA it is not measured (the host only queues the
collectives' kernels; the device timer's op time includes the waits), so a slow rank's peers
look as slow as it, and its stage is named whole (below).

A worker is *found* slow when, over the last ``slow_steps`` steps,

- its own compute stayed at least ``slow_factor`` times its baseline at each of them (the
  baseline: the lowest median of ``slow_steps`` consecutive steps it ran so far, what it
  takes when well),

and its *typical* compute over them (their median) is at least ``slow_factor`` times

- the typical compute of the same (stage, tp_rank) in the other replicas (their median; the
  same layers on the same micro-batch sizes), where there are other replicas, and
- its tensor-parallel peers' typical compute (their median), where its stage has several
  ranks: a slow rank makes its peers wait inside their F and B (their collectives), and only
  the rank whose own compute stands out from theirs is blamed (on CPU, their measured waits
  left out, the slow rank alone stands out); where none stands out and every rank of the stage
  is behind (on GPUs the waits are not measured, so a slow rank's peers look as slow as it),
  the stage is named whole, all its ranks: which of them is slow cannot be told from their
  timings, and a spare takes a whole stage's place anyway;

while its replica's other workers are not slowed alike (the median of their typical compute
over their baselines below ``slow_factor``): a whole replica slowed by one cause (its node's
neighbour, a shared link) names no worker. The comparisons with others are of medians over
the steps, so one noisy step of a peer or of another stage does not hide a slow worker.

What then is :func:`decide_slow`'s, over a :class:`SlowView`: ``on_slow="report"`` only reports;
``"replace"`` swaps each worker found slow for a warm spare that is up, at the next step
boundary (its state copied from it, alive, into the spare: nothing replayed), and reports
the ones no spare is up for; ``"rebalance"`` moves layers away from the slow workers' stages,
the same partition in every replica, at the same number of stages:

- each layer's time is *the stage's measured time spread by its layers' cost shares* (not
  per-layer timing): a stage's time is its workers' typical own compute when well (the median
  of their baselines, each over the slowdown a rebalance already took into account for it), and
  each of its layers takes the share of it that its cost (``LayerCost`` flops where every layer
  has one, else its parameter count) is of the stage's;
- every stage is weighted by the slowdown of its slowest worker in any replica (the replicas
  wait for each other at the gradient reduction, so a stage is as slow as its slowest copy), and
  the contiguous split minimising the slowest stage's weighted time is the new partition
  (:func:`raypipe.core.partition.min_max_partition` with stage weights);
- it is taken only when it cuts that slowest stage's predicted time by at least
  ``REBALANCE_MARGIN`` (5%): a pipeline's step is paced by its slowest stage, so that is the
  predicted step's gain in the steady state (the fill and drain are not modelled).

A rebalance assumes the cause is the place's (a throttled device, a noisy neighbour on the node):
the worker in that place stays slow on its new layers. Its baseline starts again with the
new layout (the history is cleared), so it is not found again at its slow pace; the controller
keeps the factors it rebalanced for until the workers change (a heal, a resize), so a later
rebalance for another worker still counts them.

:class:`ComputeHistory` is what the controller keeps between steps (the last
``slow_steps`` steps' own compute and each worker's baseline); :meth:`ComputeHistory.view`
freezes it into a :class:`ComputeView`, and :func:`find_slow` and :func:`slowdowns`
decide over that alone: no Ray, no I/O, tested on fabricated views
(``tests/control/test_stragglers.py``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from types import MappingProxyType

from raypipe.core.partition import min_max_partition, stage_layer_ranges
from raypipe.core.result import OpEvent
from raypipe.core.topology import Topology

COMPUTE_OPS = frozenset({"F", "B", "I", "W"})  # a worker's own work in a step; the rest is waiting or bookkeeping
DEFAULT_SLOW_FACTOR = 1.3
DEFAULT_SLOW_STEPS = 10
REBALANCE_MARGIN = 0.05  # a rebalance must cut the slowest stage's predicted time by this share

Worker = tuple[int, int, int]
"""A worker by its (replica, stage, tp_rank)."""


def own_compute(events: Iterable[OpEvent]) -> dict[Worker, float] | None:
    """Each worker's seconds in its compute ops (F, B, I, W) of one step's timeline, less what it spent in
    them waiting in its tensor-parallel collectives (:attr:`OpEvent.collective_wait`); None where a compute
    op's wait was not measured at this step (sampled at other steps: its time holds waits for its peers)."""
    seconds: dict[Worker, float] = {}
    for event in events:
        if event.op in COMPUTE_OPS:
            if event.collective_wait is None:
                return None
            worker = (event.replica, event.stage, event.tp_rank)
            seconds[worker] = seconds.get(worker, 0.0) + (event.end - event.start - event.collective_wait)
    return seconds


@dataclass(frozen=True)
class SlowWorker:
    """A worker found slow: where it is and its own compute's ratio to its baseline (the median of the
    last ``slow_steps`` steps')."""

    replica: int
    stage: int
    tp_rank: int
    factor: float

    @property
    def worker(self) -> Worker:
        return self.replica, self.stage, self.tp_rank


@dataclass(frozen=True)
class ComputeView:
    """The facts a slow-worker decision reads: the last steps' own compute of every worker (oldest
    first, at most ``slow_steps`` of them), each worker's baseline, and the knobs."""

    steps: tuple[Mapping[Worker, float], ...]
    baselines: Mapping[Worker, float]
    slow_factor: float = DEFAULT_SLOW_FACTOR
    slow_steps: int = DEFAULT_SLOW_STEPS


def stand_out(typical: Mapping[Worker, float], baselines: Mapping[Worker, float], slow_factor: float,
              candidates: Iterable[Worker]) -> set[Worker]:
    """Of the ``candidates``, the workers whose ``typical`` compute is at least ``slow_factor`` times
    their stage's in the other replicas and their tensor-parallel peers', their replica not slowed
    alike (the module's docstring). Linear in the workers: each is compared within its groups only."""
    same_place: dict[tuple[int, int], dict[Worker, float]] = {}  # (stage, tp_rank): every replica's
    same_stage: dict[tuple[int, int], dict[Worker, float]] = {}  # (replica, stage): its tensor-parallel ranks'
    same_replica: dict[int, dict[Worker, float]] = {}  # replica: its workers' typical compute over their baselines
    for worker, seconds in typical.items():
        replica, stage, tp_rank = worker
        same_place.setdefault((stage, tp_rank), {})[worker] = seconds
        same_stage.setdefault((replica, stage), {})[worker] = seconds
        if baselines.get(worker, 0.0) > 0.0:
            same_replica.setdefault(replica, {})[worker] = seconds / baselines[worker]
    def stands_out_of_its_stage(worker: Worker) -> bool:
        peers = [other for key, other in same_stage[worker[:2]].items() if key != worker]
        return not peers or typical[worker] >= slow_factor * median(peers)

    candidates = list(candidates)
    behind = set(candidates)
    slow = set()
    for worker in candidates:
        replica, stage, tp_rank = worker
        seconds = typical[worker]
        replicas = [other for key, other in same_place[(stage, tp_rank)].items() if key != worker]
        if replicas and seconds < slow_factor * median(replicas):
            continue
        if not stands_out_of_its_stage(worker):
            # a slow rank makes its peers wait inside their F and B, so their own compute rises with its:
            # where every rank of the stage is behind and none stands out, the stage is named whole (its
            # node: which rank is slow cannot be told from their timings); else this one is a waiter
            ranks = same_stage[(replica, stage)]
            if not (ranks.keys() <= behind and not any(stands_out_of_its_stage(rank) for rank in ranks)):
                continue
        replica_others = [ratio for key, ratio in same_replica.get(replica, {}).items() if key[1] != stage]
        if replica_others and median(replica_others) >= slow_factor:  # the whole replica: a shared cause
            continue
        slow.add(worker)
    return slow


def find_slow(view: ComputeView) -> tuple[SlowWorker, ...]:
    """The workers found slow over the view's last ``slow_steps`` steps (the module's docstring), in
    (replica, stage, tp_rank) order; none while fewer steps are known."""
    if len(view.steps) < view.slow_steps:
        return ()
    recent = view.steps[-view.slow_steps:]
    every_step = set.intersection(*(set(step) for step in recent))  # the workers that ran each of them
    typical = {worker: median(step[worker] for step in recent) for worker in every_step}
    behind = [worker for worker in sorted(every_step) if view.baselines.get(worker, 0.0) > 0.0
              and all(step[worker] >= view.slow_factor * view.baselines[worker] for step in recent)]
    slow = stand_out(typical, view.baselines, view.slow_factor, behind)
    factors = slowdowns(view)
    return tuple(SlowWorker(*worker, factors[worker]) for worker in sorted(slow))


def slowdowns(view: ComputeView) -> dict[Worker, float]:
    """Every worker's own compute over its baseline, the median over the view's last ``slow_steps``
    steps that it ran (1: as fast as when well); workers without a baseline yet are left out."""
    recent = view.steps[-view.slow_steps:]
    ratios: dict[Worker, list[float]] = {}
    for step in recent:
        for worker, seconds in step.items():
            baseline = view.baselines.get(worker, 0.0)
            if baseline > 0.0:
                ratios.setdefault(worker, []).append(seconds / baseline)
    return {worker: median(values) for worker, values in sorted(ratios.items())}


@dataclass(frozen=True)
class SlowView:
    """What a slow-worker decision reads besides the workers ``found`` slow now: the action asked for
    (``on_slow``), the warm spares up now, and the layout's ranks; for a rebalance, the layers per
    stage in force (``balance``), each stage's time when well (``stage_seconds``, see
    :func:`well_stage_seconds`), each layer's cost (``layer_costs``: its share of its stage's time)
    and the workers a rebalance already moved layers off (``rebalanced``, still slow in their places)."""

    found: tuple[SlowWorker, ...]
    on_slow: str
    spares_up: int
    num_stages: int
    replicas: int
    tensor_parallel: int = 1
    balance: tuple[int, ...] = ()
    stage_seconds: tuple[float, ...] = ()
    layer_costs: tuple[float, ...] = ()
    rebalanced: tuple[SlowWorker, ...] = ()


@dataclass(frozen=True)
class ReportSlow:
    """Only report the workers found slow; ``why`` none (or not every one) is replaced."""

    why: str


@dataclass(frozen=True)
class ReplaceSlow:
    """At the next step boundary, swap the workers ``ranks`` (found slow) for warm spares, each
    taking its state from the worker it replaces; ``left``: those found slow with no spare up for
    them, ``why`` they are left in place."""

    ranks: tuple[int, ...]
    left: tuple[int, ...] = ()
    why: str = "no more warm spares are up"


@dataclass(frozen=True)
class RebalanceSlow:
    """At the next step boundary, split the layers as ``balance`` (layers per stage, in every replica),
    away from the slow workers' stages: the slowest stage's predicted seconds per step ``before`` and
    ``after``; ``slowed``: each worker's slowdown it was balanced for (those found and those
    rebalanced for before)."""

    balance: tuple[int, ...]
    before: float
    after: float
    slowed: tuple[SlowWorker, ...]


SlowDecision = ReportSlow | ReplaceSlow | RebalanceSlow


def decide_slow(view: SlowView) -> SlowDecision:
    """``on_slow="replace"`` with warm spares up: the workers found slow, as many as there are spares up
    (in rank order), are replaced (at ``tensor_parallel`` t > 1 a spare is a group of t on one node: each
    takes the whole stage of a worker found slow, its t ranks, stage by stage in rank order);
    ``"rebalance"``: :func:`rebalance` decides; else (``"report"``, nothing found, no spare up) they are
    reported."""
    if view.on_slow not in ("replace", "rebalance"):
        return ReportSlow(f"on_slow={view.on_slow!r}")
    if not view.found:
        return ReportSlow("no worker is slow")
    if view.on_slow == "rebalance":
        return rebalance(view)
    if view.spares_up < 1:
        return ReportSlow("no warm spare is up to take a slow worker's place")
    topology = Topology(view.num_stages, view.replicas, view.tensor_parallel)
    if view.tensor_parallel > 1:
        # a spare is a group of t processes on one node: it takes a whole stage's place (one rank alone would
        # sit on another node than its peers), each of its processes one tp_rank's state
        stages = sorted({(slow.replica, slow.stage) for slow in view.found})
        whole = [topology.tensor_ranks(replica, stage) for replica, stage in stages]
        return ReplaceSlow(tuple(rank for ranks in whole[:view.spares_up] for rank in ranks),
                           tuple(rank for ranks in whole[view.spares_up:] for rank in ranks))
    ranks = tuple(sorted(topology.rank(*slow.worker) for slow in view.found))
    return ReplaceSlow(ranks[:view.spares_up], ranks[view.spares_up:])


def rebalance(view: SlowView) -> RebalanceSlow | ReportSlow:
    """The partition at the same number of stages whose slowest stage, each stage's time (its layers'
    times, :func:`layer_seconds`) weighted by its slowest worker's slowdown (:func:`stage_slowdowns`),
    is fastest; reported instead where it is not ``REBALANCE_MARGIN`` faster than the partition in
    force, or a stage has no time measured when well."""
    if len(view.stage_seconds) != view.num_stages or not all(seconds > 0 for seconds in view.stage_seconds):
        return ReportSlow("a stage has no compute measured when well")
    slowed = merged_slowdowns(view.found, view.rebalanced)
    weights = stage_slowdowns(slowed, view.num_stages)
    times = layer_seconds(view.balance, view.stage_seconds, view.layer_costs)
    before = slowest_stage_seconds(times, view.balance, weights)
    balance = tuple(min_max_partition(times, view.num_stages, stage_weights=weights))
    after = slowest_stage_seconds(times, balance, weights)
    if after > (1.0 - REBALANCE_MARGIN) * before:
        return ReportSlow(f"moving layers would not speed the slowest stage by {REBALANCE_MARGIN:.0%} "
                          f"({before:.4g}s -> {after:.4g}s predicted)")
    return RebalanceSlow(balance, before, after, slowed)


def merged_slowdowns(found: Iterable[SlowWorker], rebalanced: Iterable[SlowWorker]) -> tuple[SlowWorker, ...]:
    """Each worker's slowdown against its pace when well: a worker found slow again after a rebalance
    for it was found against its slow pace, so its factors multiply. In (replica, stage, tp_rank) order."""
    factors: dict[Worker, float] = {}
    for slow in (*rebalanced, *found):
        factors[slow.worker] = factors.get(slow.worker, 1.0) * slow.factor
    return tuple(SlowWorker(*worker, factor) for worker, factor in sorted(factors.items()))


def stage_slowdowns(slowed: Iterable[SlowWorker], num_stages: int) -> list[float]:
    """Each stage's weight: the slowdown of its slowest worker in any replica (1: none is slow)."""
    weights = [1.0] * num_stages
    for slow in slowed:
        weights[slow.stage] = max(weights[slow.stage], slow.factor)
    return weights


def layer_seconds(balance: Sequence[int], stage_seconds: Sequence[float], layer_costs: Sequence[float]
                  ) -> list[float]:
    """Each layer's seconds: its stage's (under ``balance``) spread over its layers by their shares of
    the stage's ``layer_costs`` (equal shares where they sum to nothing)."""
    times = []
    for layers, seconds in zip(stage_layer_ranges(balance), stage_seconds, strict=True):
        costs = [layer_costs[index] for index in layers]
        total = sum(costs)
        times += [seconds * cost / total if total > 0 else seconds / len(costs) for cost in costs]
    return times


def slowest_stage_seconds(times: Sequence[float], balance: Sequence[int], weights: Sequence[float]) -> float:
    """The slowest stage's seconds under ``balance``: its layers' ``times`` times its weight."""
    return max(weight * sum(times[index] for index in layers)
               for layers, weight in zip(stage_layer_ranges(balance), weights, strict=True))


def well_stage_seconds(baselines: Mapping[Worker, float], num_stages: int,
                       rebalanced: Iterable[SlowWorker] = ()) -> tuple[float, ...]:
    """Each stage's own compute per step when well: the median of its workers' baselines, each over the
    slowdown a rebalance already took into account for it (its baseline since is its slow pace); 0 for a
    stage no baseline is known of."""
    known = {slow.worker: slow.factor for slow in rebalanced}
    per_stage: dict[int, list[float]] = {}
    for worker, seconds in baselines.items():
        per_stage.setdefault(worker[1], []).append(seconds / known.get(worker, 1.0))
    return tuple(median(per_stage[stage]) if stage in per_stage else 0.0 for stage in range(num_stages))


@dataclass
class ComputeHistory:
    """The controller's record of the workers' own compute: the last ``slow_steps`` steps, each
    worker's baseline (the lowest median of ``slow_steps`` consecutive steps so far), and the workers
    reported slow (reported once until they are well again). Cleared when the layout changes: other
    workers, or other layers on them."""

    slow_factor: float = DEFAULT_SLOW_FACTOR
    slow_steps: int = DEFAULT_SLOW_STEPS
    steps: deque = field(default_factory=deque)
    baselines: dict[Worker, float] = field(default_factory=dict)
    reported: frozenset[Worker] = frozenset()

    def record(self, events: Sequence[OpEvent]) -> None:
        """One step's timeline (every worker's events); its workers' baselines updated. A step whose own
        compute is not known (:func:`own_compute`: a tensor-parallel CPU run's waits are measured at one
        step in ``COLLECTIVE_WAIT_EVERY``) is left out: ``slow_steps`` counts the steps measured."""
        seconds = own_compute(events)
        if seconds is None:
            return
        self.steps.append(MappingProxyType(seconds))
        while len(self.steps) > self.slow_steps:
            self.steps.popleft()
        if len(self.steps) < self.slow_steps:
            return
        for worker in self.steps[-1]:
            values = [step[worker] for step in self.steps if worker in step]
            if len(values) == self.slow_steps:
                typical = median(values)
                if typical > 0.0 and typical < self.baselines.get(worker, float("inf")):
                    self.baselines[worker] = typical

    def view(self) -> ComputeView:
        """The history now, frozen."""
        return ComputeView(tuple(self.steps), MappingProxyType(dict(self.baselines)), self.slow_factor,
                           self.slow_steps)

    def newly_slow(self, slow: Iterable[SlowWorker]) -> tuple[SlowWorker, ...]:
        """Of the workers found ``slow`` now, those not reported since they were last well; the
        reported set becomes ``slow``'s workers."""
        slow = tuple(slow)
        new = tuple(worker for worker in slow if worker.worker not in self.reported)
        self.reported = frozenset(worker.worker for worker in slow)
        return new

    def clear(self) -> None:
        """Forget every step and baseline (the workers or their layers changed)."""
        self.steps.clear()
        self.baselines.clear()
        self.reported = frozenset()


__all__ = ["COMPUTE_OPS", "ComputeHistory", "ComputeView", "DEFAULT_SLOW_FACTOR", "DEFAULT_SLOW_STEPS",
           "REBALANCE_MARGIN", "RebalanceSlow", "ReplaceSlow", "ReportSlow", "SlowDecision", "SlowView", "SlowWorker",
           "Worker", "decide_slow", "find_slow", "layer_seconds", "merged_slowdowns", "own_compute", "rebalance",
           "slowdowns", "slowest_stage_seconds", "stage_slowdowns", "stand_out", "well_stage_seconds"]
