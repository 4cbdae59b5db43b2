"""Deterministic fault injection for the control plane, without Ray.

A :class:`FakeRay` stands in for ``ray.get``/``ray.wait``/``ray.kill`` (a test
installs it over the ``ray`` module with ``monkeypatch``), and fabricated
workers (:class:`FakeActor`), groups (:class:`FakeGroup`) and an executor
(:class:`FakeExecutor`) take the place of the Ray-backed ones under the real
controller, recovery, resizer and partitioning. Every ``actor.method.remote()``
goes through :meth:`FakeRay.call`, where scripted :class:`Fault` s fire: at the
n-th call of a method (on any worker, or on the worker at given coordinates),
the named workers die. A dead worker's calls fail with Ray's own
``ActorDiedError``, as they do in a cluster, so the mechanisms meet exactly the
errors they meet there, at a point a test picks.

A :class:`Slowdown` makes one worker slow instead of dead: from a data step on, its
fabricated compute (one timed F op a step, ``FakeExecutor.compute_s``) takes a factor longer;
the worker that replaces it is as fast as the others, unless the slowdown is its place's (a
throttled device: whatever worker runs there is slow). ``FakeGroup.spares_up`` warm spares take
replaced workers' places. With ``FakeExecutor.layer_s`` (each layer's seconds per micro-batch, as
timed layers sleep them) a worker's compute is that of the layers its spec holds, and each step's
time (``FakeExecutor.step_times``) is the schedule's timed run (:mod:`raypipe.core.timed_simulation`)
with those times, the slowest replica's: a partition's and a slowdown's effect on the step, cheaply.
On real processes, :func:`slow_down_worker` does the same to a Ray worker running timed layers.

Each worker's state is the list of data steps it committed, so a test compares
every worker's history with an uninterrupted run's (``0, 1, ..., n-1``): a heal
that loses, repeats or mixes a step shows as a wrong history, the logical form
of "bitwise equal".

Only errors, core, the timed layers and ray are imported (the testing layer);
the test installs the fakes into the executor and control modules.
"""
from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from raypipe.core.lowering import lower
from raypipe.core.result import OpEvent, StageReport, StageStats
from raypipe.core.timed_simulation import simulate_timed
from raypipe.core.topology import Topology
from raypipe.errors import PlacementError, RaypipeError, WorkersFailed
from raypipe.testing.timed_layers import slow_down

CALLER = "caller"  # a fault that kills the worker called (a replacement dying while it starts)


@dataclass
class Fault:
    """At the ``nth`` call of ``method`` (on the worker at ``on``, (replica, stage) in
    the running group -- (replica, stage, tp_rank) with tensor parallelism -- or on any), the
    workers at ``kill`` die: places in the running group, or :data:`CALLER`. ``times``: how
    many calls in a row it fires on."""

    method: str
    kill: Sequence[tuple[int, ...]] | str = CALLER
    nth: int = 1
    on: tuple[int, ...] | None = None
    times: int = 1
    seen: int = 0  # matching calls so far
    fired: int = 0


@dataclass(frozen=True)
class Slowdown:
    """From data step ``from_step`` on, the worker at ``on`` ((replica, stage) in the running group
    at that step, (replica, stage, tp_rank) with tensor parallelism) computes ``factor`` times as
    long: slow, not dead. ``of_place``: the cause is the place's (its device, its node), so whatever
    worker runs there is slow (one started again there too); else the worker's own (one that
    replaces it is not)."""

    on: tuple[int, ...]
    from_step: int
    factor: float
    of_place: bool = False


def slow_down_worker(actor: Any, factor: float) -> None:
    """Make the Ray worker ``actor`` slow, not dead: every timed layer in its process sleeps
    ``factor`` times its times from its next op on (:func:`raypipe.testing.timed_layers.slow_down`).
    Call it between steps: it runs as one of the actor's calls (Ray's ``__ray_call__``)."""
    ray.get(actor.__ray_call__.remote(_slow_down_in, factor))


def _slow_down_in(worker: Any, factor: float) -> None:
    slow_down(factor)


class FakeRef:
    """A finished task's result: its value, or the error ``ray.get`` raises."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class FakeMethod:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> FakeRef:
        return self.actor.fake_ray.call(self.actor, self.name, args)


class FakeActor:
    """A stage worker: its state is the data steps it committed (``steps``)."""

    def __init__(self, fake_ray: FakeRay, name: str) -> None:
        self.fake_ray, self.name, self.alive, self.steps = fake_ray, name, True, ()

    def __getattr__(self, name: str) -> FakeMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return FakeMethod(self, name)

    def __repr__(self) -> str:
        return f"FakeActor({self.name}{'' if self.alive else ', dead'})"

    def answer(self, method: str, args: tuple) -> Any:
        """What a call of ``method`` returns (and does to the state)."""
        if method == "snapshot":
            return self.steps
        if method == "restore":
            self.steps = args[0].value
        elif method == "adopt":  # every snapshot adopted must be of the same step history
            histories = {ref.value for ref in args}
            if len(histories) != 1:
                raise AssertionError(f"{self.name} adopted snapshots of different steps: {sorted(histories)}")
            self.steps = histories.pop()
        elif method == "committed_steps":
            return len(self.steps)
        elif method == "ready" or method == "become":
            return {"num_parameters": 10, "device_name": "cpu"}
        elif method == "evaluate":
            return 1.0
        elif method == "rendezvous_address":
            return ("127.0.0.1", 0)
        return None


class FakeRay:
    """``ray.get``/``wait``/``kill`` over :class:`FakeRef` s, firing ``faults`` as calls are made."""

    def __init__(self, faults: Sequence[Fault] = ()) -> None:
        self.faults = list(faults)
        self.executor: FakeExecutor | None = None  # the group at that moment names the coordinates
        self.created = 0
        self.calls: list[tuple[str, str]] = []

    def actor(self, prefix: str = "worker") -> FakeActor:
        self.created += 1
        return FakeActor(self, f"{prefix}-{self.created}")

    def where(self, actor: FakeActor) -> tuple[int, ...] | None:
        group = None if self.executor is None else self.executor.group
        if group is None or actor not in group.actors:
            return None
        return self.executor.topology().place(group.actors.index(actor))

    def call(self, actor: FakeActor, method: str, args: tuple) -> FakeRef:
        self.calls.append((actor.name, method))
        for fault in self.faults:
            if fault.method != method or fault.fired >= fault.times:
                continue
            if fault.on is not None and self.where(actor) != fault.on:
                continue
            fault.seen += 1
            if fault.seen >= fault.nth:
                fault.fired += 1
                self._kill_for(fault, actor)
        if not actor.alive:
            return FakeRef(error=ray.exceptions.ActorDiedError())
        for arg in args:
            if isinstance(arg, FakeRef) and arg.error is not None:  # an argument's failure is the task's
                return FakeRef(error=arg.error)
        try:
            return FakeRef(actor.answer(method, args))
        except AssertionError as error:
            return FakeRef(error=error)

    def _kill_for(self, fault: Fault, caller: FakeActor) -> None:
        if fault.kill == CALLER:
            caller.alive = False
            return
        group, topology = self.executor.group, self.executor.topology()
        for place in fault.kill:
            group.actors[topology.rank(*place)].alive = False

    # -- the ray API the mechanisms use ----------------------------------------------------
    def get(self, refs: Any, timeout: float | None = None) -> Any:
        if isinstance(refs, FakeRef):
            if refs.error is not None:
                raise refs.error
            return refs.value
        return [self.get(ref) for ref in refs]

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None, fetch_local: bool = True
             ) -> tuple[list, list]:
        pending = [ref for ref in refs if isinstance(ref, FakePlacement) and not ref.placed()]
        return [ref for ref in refs if ref not in pending], pending

    def kill(self, actor: Any, **kwargs: Any) -> None:
        if isinstance(actor, FakeActor):
            actor.alive = False

    def install(self, setattr_: Callable[[Any, str, Any], None]) -> None:
        """Put this in the place of ``ray.get``/``wait``/``kill`` (``setattr_``: a
        monkeypatch's, so that it is undone), and make ``ray.init`` fail."""
        for name in ("get", "wait", "kill"):
            setattr_(ray, name, getattr(self, name))

        def no_ray(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a fault-injection test started Ray")

        setattr_(ray, "init", no_ray)


@dataclass(frozen=True)
class FakeWorkerInfo:
    replica: int
    stage: int
    node_id: str
    pid: int
    tp_rank: int = 0


class FakeGroup:
    """A StageGroup's surface over :class:`FakeActor` s. A replacement is started, pinged
    and, if it died while it started, raises Ray's error as the real one does;
    ``no_room`` (attempts left) makes a replacement raise :class:`PlacementError`."""

    fake_ray: FakeRay | None = None  # set by the test: the class is what the controller constructs
    no_room = 0
    spares_up = 0  # warm spares up: a replacement takes one while any is

    def __init__(self, actor_class: Any, specs: list, bundle: Any = None, timeout_s: float = 0,
                 placed: Any = None) -> None:
        self.specs = list(specs)
        self.actors = [self.fake_ray.actor() for _ in specs]
        self.stopped = False
        self.replaced: list[int] = []

    @property
    def workers(self) -> list[FakeWorkerInfo]:
        return [FakeWorkerInfo(spec.replica, spec.stage, "node", rank, spec.tp_rank)
                for rank, spec in enumerate(self.specs)]

    @property
    def spares(self) -> Any:
        return types.SimpleNamespace(up_count=lambda: FakeGroup.spares_up)

    def wait_ready(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        return ray.get([actor.ready.remote() for actor in self.actors])

    def spec(self, rank: int) -> Any:
        return self.specs[rank]

    def index_of(self, error: Any) -> int | None:
        return None

    def kill(self, indices: list[int]) -> None:
        for index in indices:
            self.actors[index].alive = False

    def replace(self, indices: list[int], timeout_s: float | None = None) -> dict[int, str]:
        if FakeGroup.no_room:
            FakeGroup.no_room -= 1
            raise PlacementError("no room", tuple(indices))
        self.kill(indices)
        spares = {}
        t = self.specs[0].config.tensor_parallel if self.specs else 1  # a spare: a group of t taking a whole stage
        for stage in sorted({index // t for index in indices}):
            ranks = [index for index in sorted(indices) if index // t == stage]
            if FakeGroup.spares_up and len(ranks) == t:
                FakeGroup.spares_up -= 1
                name = f"spare {len(self.replaced) + len(spares)}"
                spares.update({index: name for index in ranks})
            for index in ranks:
                self.actors[index] = self.fake_ray.actor("spare" if index in spares else "replacement")
        self.replaced += indices
        ray.get([self.actors[index].ready.remote() for index in indices])  # a dead one raises, as in Ray
        return spares

    def drop_replicas(self, replicas: set[int]) -> list[int]:
        kept = [rank for rank, spec in enumerate(self.specs) if spec.replica not in replicas]
        for rank, spec in enumerate(self.specs):
            if spec.replica in replicas:
                self.actors[rank].alive = False
        self.actors = [self.actors[rank] for rank in kept]
        self.specs = [self.specs[rank] for rank in kept]
        return kept

    def set_specs(self, specs: list) -> None:
        self.specs = list(specs)

    def start_replica(self, placement: Any, specs: list) -> Any:
        actors = [self.fake_ray.actor("new-replica") for _ in specs]

        def cancel() -> None:
            for actor in actors:
                actor.alive = False

        return types.SimpleNamespace(ready=[actor.ready.remote() for actor in actors], cancel=cancel, actors=actors,
                                     specs=list(specs), placement=placement)

    def admit(self, replica: Any) -> None:
        self.actors += replica.actors
        self.specs += replica.specs

    def shutdown(self) -> None:
        self.stopped = True
        for actor in self.actors:
            actor.alive = False


@dataclass
class FakeExecutor:
    """Runs steps at once over a :class:`FakeGroup`: a step commits on every worker or on
    none (a dead worker fails it with :class:`WorkersFailed`); the transport's calls
    (leave, join, take a layout) go to the workers and fail as Ray's do."""

    config: Any
    schedule: Any
    usable: bool = True
    group: Any = None
    in_flight: Any = None
    steps_run: list[int] = field(default_factory=list)
    compute_s: float = 0.01  # each worker's fabricated compute a step (one F op on its timeline)
    layer_s: tuple[float, ...] | None = None  # else: each layer's compute per micro-batch (F a third, B the rest)
    step_times: list[float] = field(default_factory=list)  # with layer_s: each step's timed run, in seconds
    slowdowns: list[Slowdown] = field(default_factory=list)
    slowed: dict[int, FakeActor] = field(default_factory=dict)  # slowdowns (by position) -> the worker they slow

    def __post_init__(self) -> None:
        FakeGroup.fake_ray.executor = self

    def actor_class(self) -> Any:
        return object

    def connect(self, group: FakeGroup) -> None:
        self.group = group
        ray.get([actor.join_group.remote() for actor in group.actors])

    def close(self) -> None:
        pass

    def check_usable(self) -> None:
        if not self.usable:
            raise RaypipeError("the pipeline cannot be made whole again")

    def topology(self) -> Topology:
        """The running group's ranks, ``tensor_parallel`` workers a stage."""
        return Topology.of_workers(self.config.num_stages, len(self.group.actors), self.config.tensor_parallel)

    def _dead(self) -> dict[tuple[int, ...], str]:
        topology = self.topology()
        return {topology.place(rank): "died" for rank, actor in enumerate(self.group.actors) if not actor.alive}

    def start_step(self, data_step: int, batch: Any, loss_scale: Any, snapshot: bool = False) -> tuple[Any, Any]:
        """The executor's start of a step: here only what :meth:`finish_step` runs, with the snapshot
        due taken first (as the tasks path orders it)."""
        return (data_step, batch, loss_scale), self.snapshot_workers(self.group.actors) if snapshot else None

    def finish_step(self, submitted: tuple[int, Any, Any]) -> Any:
        return self.run_step(*submitted)

    def run_step(self, data_step: int, batch: Any, loss_scale: Any) -> Any:
        """The whole step, run when :meth:`finish_step` waits for it."""
        started = [actor.run_step.remote(data_step) for actor in self.group.actors]
        dead = self._dead()
        if dead or any(ref.error is not None for ref in started):
            raise WorkersFailed(data_step, dead or {(0, 0): "died"})
        for actor in self.group.actors:  # committed everywhere
            actor.steps = (*actor.steps, data_step)
        self.steps_run.append(data_step)
        reports, topology = [], self.topology()
        per_micro_batch: dict[tuple[int, int], float] = {}  # (replica, stage): a micro-batch's compute (layer_s)
        for rank, actor in enumerate(self.group.actors):
            place, (replica, stage, tp_rank) = topology.place(rank), topology.coordinates(rank)
            factor = self._slowdown(actor, place, data_step)
            seconds = self.compute_s * factor
            if self.layer_s is not None:
                per_micro_batch[replica, stage] = factor * sum(self.layer_s[i] for i in self.group.spec(rank)
                                                               .layer_indices)
                seconds = self.config.num_micro_batches * per_micro_batch[replica, stage]
            start = float(data_step)  # a fabricated clock: a second a step
            reports.append(StageReport([OpEvent(stage, "F", 0, start, start + seconds, replica, tp_rank=tp_rank)],
                                       StageStats(stage, replica=replica, tp_rank=tp_rank), None,
                                       commits=len(actor.steps)))
        if self.layer_s is not None:
            self.step_times.append(self._step_time(per_micro_batch, topology.num_replicas))
        return types.SimpleNamespace(decision=None, reports=reports)

    def _slowdown(self, actor: FakeActor, place: tuple[int, ...], data_step: int) -> float:
        """How many times slower ``actor``, at ``place``, computes at ``data_step``."""
        factor = 1.0
        for position, slowdown in enumerate(self.slowdowns):
            if slowdown.on == place and data_step >= slowdown.from_step:
                if slowdown.of_place:
                    factor *= slowdown.factor
                    continue
                self.slowed.setdefault(position, actor)  # the worker there when it starts: it, not its place
            if self.slowed.get(position) is actor:
                factor *= slowdown.factor
        return factor

    def _step_time(self, per_micro_batch: dict[tuple[int, int], float], num_replicas: int) -> float:
        """The step's seconds: the schedule's timed run with each stage's compute (F a third of a
        micro-batch's, B two, I and W one each), of the slowest replica (they meet at the reduction)."""
        lowered = lower(self.schedule, self.config.placement)
        runs = []
        for replica in range(num_replicas):
            op_seconds = {}
            for stage in range(self.config.num_stages):
                third = per_micro_batch[replica, stage] / 3
                op_seconds.update({(stage, "F"): third, (stage, "B"): 2 * third, (stage, "I"): third,
                                   (stage, "W"): third})
            runs.append(simulate_timed(lowered, op_seconds).step_s)
        return max(runs)

    def evaluate(self, step: int, batch: Any) -> float:
        return sum(self.get([actor.evaluate.remote(step) for actor in self.group.actors]))

    def snapshot_workers(self, actors: list) -> types.SimpleNamespace:
        # the executor's SnapshotTasks (a layer above): each stored with its task, as the tasks path does
        return types.SimpleNamespace(states=[actor.snapshot.remote() for actor in actors], stored=None)

    def drain(self, failed: Any) -> dict[int, str]:
        return {rank: "died" for rank, actor in enumerate(self.group.actors) if not actor.alive and rank not in failed}

    def reconnect(self, survivors: list) -> None:
        ray.get([actor.leave_group.remote() for actor in survivors])
        ray.get([actor.join_group.remote() for actor in self.group.actors])

    def relayout(self, survivors: list) -> None:
        ray.get([actor.leave_group.remote() for actor in survivors])
        ray.get([actor.take_layout.remote(self.group.spec(rank)) for rank, actor in enumerate(self.group.actors)])
        ray.get([actor.join_group.remote() for actor in self.group.actors])

    def before_next_step(self, actors: list) -> None:
        pass

    def get(self, refs: list) -> list:
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as error:
            raise RaypipeError(f"stage worker ? died: {error}") from None

    def wait(self, refs: list) -> None:
        ray.wait(refs, num_returns=len(refs), fetch_local=False)

    def get_watched(self, refs: list) -> list:
        return ray.get(refs)


class FakePlacement:
    """A placement group asked for: placed once ``FakePlacement.condition()`` holds
    (a test may set it; default: at once)."""

    condition: Callable[[], bool] = lambda: True  # read through the class: a plain function

    def placed(self) -> bool:
        return FakePlacement.condition()

    def ready(self) -> FakePlacement:
        return self  # what ray.wait waits on


def fake_cluster(num_replicas_placed: int | None = None) -> types.SimpleNamespace:
    """``raypipe.runtime.cluster``'s surface the controller uses: one node with room for
    everything (``num_replicas_placed``: how many replicas the start places, else max)."""
    def reserve_between(low: int, high: int, bundles: list, timeout: float) -> tuple[list, list]:
        placed = high if num_replicas_placed is None else num_replicas_placed
        return [FakePlacement()] * placed, [FakePlacement()] * (high - placed)

    return types.SimpleNamespace(
        connect=lambda address, cpus: None, resolve_use_gpu=lambda config: False, num_alive_nodes=lambda: 1,
        worker_bundle=lambda config, use_gpu: {"CPU": 1.0}, worker_memory_bytes=lambda device_memory: 2**40,
        stage_bundle=lambda worker, t: {name: amount * t for name, amount in worker.items()},
        placeable_workers=lambda bundle, freed=(): len(freed), release=lambda groups: None,
        describe_available=lambda: "nothing", reserve_between=reserve_between)


def fake_spread() -> types.SimpleNamespace:
    return types.SimpleNamespace(replica_group=lambda bundles: FakePlacement(),
                                 relocate=lambda placement, bundles, nodes: placement)


def fake_resource_request(bundles: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(request=lambda count: None, withdraw=lambda: None)


__all__ = ["CALLER", "FakeActor", "FakeExecutor", "FakeGroup", "FakePlacement", "FakeRay", "FakeRef", "Fault",
           "Slowdown", "fake_cluster", "fake_resource_request", "fake_spread", "slow_down_worker"]
