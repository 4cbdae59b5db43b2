"""Slow workers: found from each worker's own compute per step, a pure decision over a frozen view.

At scale the common fault is a slow worker, not a dead one (a throttling GPU, a noisy
neighbour): a pipeline runs at its slowest stage's pace, and every replica waits for it at
the gradient reduction. A worker's *own compute* in a step is the time of its compute ops
(F, B, I, W) from its timeline, not the step's wall time: receives, the step gate and the
reduction are waiting, and a worker that waits for a slow neighbour is not slow itself.

A worker is *found* slow when, over the last ``slow_steps`` steps,

- its own compute stayed at least ``slow_factor`` times its baseline at each of them (the
  baseline: the lowest median of ``slow_steps`` consecutive steps it ran so far, what it
  takes when well),

and its *typical* compute over them (their median) is at least ``slow_factor`` times

- the typical compute of the same (stage, tp_rank) in the other replicas (their median; the
  same layers on the same micro-batch sizes), where there are other replicas, and
- its tensor-parallel peers' typical compute (their median), where its stage has several
  ranks: a slow rank makes its peers wait inside their F and B (their collectives), and only
  the rank whose own compute stands out from theirs is blamed;

while its replica's other workers are not slowed alike (the median of their typical compute
over their baselines below ``slow_factor``): a whole replica slowed by one cause (its node's
neighbour, a shared link) names no worker. The comparisons with others are of medians over
the steps, so one noisy step of a peer or of another stage does not hide a slow worker.

What then is :func:`decide_slow`'s, over a :class:`SlowView`: ``on_slow="report"`` only reports;
``"replace"`` swaps each worker found slow for a warm spare that is up, at the next step
boundary (its state copied from it, alive, into the spare: nothing replayed), and reports
the ones no spare is up for.

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

from raypipe.core.result import OpEvent
from raypipe.core.topology import Topology

COMPUTE_OPS = frozenset({"F", "B", "I", "W"})  # a worker's own work in a step; the rest is waiting or bookkeeping
DEFAULT_SLOW_FACTOR = 1.3
DEFAULT_SLOW_STEPS = 10

Worker = tuple[int, int, int]
"""A worker by its (replica, stage, tp_rank)."""


def own_compute(events: Iterable[OpEvent]) -> dict[Worker, float]:
    """Each worker's seconds in its compute ops (F, B, I, W) of one step's timeline."""
    seconds: dict[Worker, float] = {}
    for event in events:
        if event.op in COMPUTE_OPS:
            worker = (event.replica, event.stage, event.tp_rank)
            seconds[worker] = seconds.get(worker, 0.0) + (event.end - event.start)
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
    slow = set()
    for worker in candidates:
        replica, stage, tp_rank = worker
        seconds = typical[worker]
        replicas = [other for key, other in same_place[(stage, tp_rank)].items() if key != worker]
        if replicas and seconds < slow_factor * median(replicas):
            continue
        tensor_peers = [other for key, other in same_stage[(replica, stage)].items() if key != worker]
        if tensor_peers and seconds < slow_factor * median(tensor_peers):
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
    (``on_slow``), the warm spares up now, and the layout's ranks."""

    found: tuple[SlowWorker, ...]
    on_slow: str
    spares_up: int
    num_stages: int
    replicas: int
    tensor_parallel: int = 1


@dataclass(frozen=True)
class ReportSlow:
    """Only report the workers found slow; ``why`` none (or not every one) is replaced."""

    why: str


@dataclass(frozen=True)
class ReplaceSlow:
    """At the next step boundary, swap the workers ``ranks`` (found slow) for warm spares, each
    taking its state from the worker it replaces; ``left``: those found slow with no spare up for them."""

    ranks: tuple[int, ...]
    left: tuple[int, ...] = ()


SlowDecision = ReportSlow | ReplaceSlow


def decide_slow(view: SlowView) -> SlowDecision:
    """``on_slow="replace"`` with warm spares up: the workers found slow, as many as there are spares up
    (in rank order), are replaced; else (``"report"``, nothing found, no spare up) they are reported."""
    if view.on_slow != "replace":
        return ReportSlow(f"on_slow={view.on_slow!r}")
    if not view.found:
        return ReportSlow("no worker is slow")
    if view.spares_up < 1:
        return ReportSlow("no warm spare is up to take a slow worker's place")
    topology = Topology(view.num_stages, view.replicas, view.tensor_parallel)
    ranks = tuple(sorted(topology.rank(*slow.worker) for slow in view.found))
    return ReplaceSlow(ranks[:view.spares_up], ranks[view.spares_up:])


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
        """One step's timeline (every worker's events); its workers' baselines updated."""
        self.steps.append(MappingProxyType(own_compute(events)))
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
           "ReplaceSlow", "ReportSlow", "SlowDecision", "SlowView", "SlowWorker", "Worker", "decide_slow", "find_slow",
           "own_compute", "slowdowns", "stand_out"]
