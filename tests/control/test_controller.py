"""The controller's states, on fabricated workers (no Ray cluster): start -> running, a heal,
a shrink, a grow, a re-partition and the way back, a heal that cannot go on, shutdown. Each
transition must log ``controller <from> -> <to> (<reason>)`` once and move the
``raypipe_controller_state`` gauge; the real controller and its mechanisms run over
fake groups, executors and a fake ``ray`` whose calls answer at once."""
from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import ray
from torch import nn

from raypipe.config import PipelineConfig
from raypipe.control import controller as controller_module
from raypipe.control import partitioning as partitioning_module
from raypipe.control.controller import STATES, Controller, ControllerState, Layout, StageModel
from raypipe.control.states import Healing, Running
from raypipe.core.result import StageReport
from raypipe.runtime import cluster, health
from raypipe.errors import PlacementError, TooManyFailures, WorkersFailed
from raypipe.executor.base import SnapshotTasks
from raypipe.control import elastic, snapshots, state_transfer
from raypipe.observability.metrics import MetricsExporter
from raypipe.runtime.group import WorkerInfo


class Call:
    """``actor.method``: ``.remote(...)`` answers at once with ``answer``."""

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer

    def remote(self, *args: Any) -> Any:
        return self.answer


class FakeActor:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.snapshot = Call(f"snapshot of {rank}")
        self.committed_steps = Call(0)
        for name in ("restore", "adopt", "copy_from", "abort_step", "attach_datasets"):
            setattr(self, name, Call())


class FakeGroup:
    """A StageGroup's surface: workers by rank, replaced in place or found no room for."""

    no_room = False  # replace raises PlacementError for every failed worker

    def __init__(self, actor_class: Any, specs: list, bundle: Any = None, timeout_s: float = 0,
                 placed: Any = None) -> None:
        self.specs = list(specs)
        self.actors = [FakeActor(rank) for rank in range(len(specs))]
        self.killed: list[int] = []
        self.stopped = False

    @property
    def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo(spec.replica, spec.stage, "node", 1000 + rank) for rank, spec in enumerate(self.specs)]

    def wait_ready(self) -> list[dict[str, Any]]:
        return [{"num_parameters": 10, "device_name": "cpu"} for _ in self.specs]

    def spec(self, rank: int) -> Any:
        return self.specs[rank]

    def kill(self, indices: list[int]) -> None:
        self.killed += indices

    def replace(self, indices: list[int], timeout_s: float | None = None) -> dict:
        if FakeGroup.no_room:
            raise PlacementError("no room", tuple(indices))
        for index in indices:
            self.actors[index] = FakeActor(index)
        return {}

    def drop_replicas(self, replicas: set[int]) -> list[int]:
        kept = [rank for rank, spec in enumerate(self.specs) if spec.replica not in replicas]
        self.actors = [self.actors[rank] for rank in kept]
        return kept

    def set_specs(self, specs: list) -> None:
        self.specs = list(specs)

    def start_replica(self, placement: Any, specs: list) -> Any:
        return types.SimpleNamespace(ready=["ready"] * len(specs), cancel=lambda: None,
                                     actors=[FakeActor(100 + stage) for stage in range(len(specs))])

    def admit(self, replica: Any) -> None:
        self.actors += replica.actors

    def shutdown(self) -> None:
        self.stopped = True


class FakeExecutor:
    """Runs steps instantly; ``fail_next`` scripts the WorkersFailed the next steps raise."""

    def __init__(self, config: PipelineConfig, schedule: Any) -> None:
        self.config, self.schedule, self.usable, self.group = config, schedule, True, None
        self.fail_next: list[dict[tuple[int, int], str]] = []
        self.steps_run: list[int] = []

    def actor_class(self) -> Any:
        return object

    def connect(self, group: FakeGroup) -> None:
        self.group = group

    def close(self) -> None:
        pass

    def check_usable(self) -> None:
        pass

    def start_step(self, data_step: int, batch: Any, loss_scale: Any, snapshot: bool = False) -> tuple[Any, Any]:
        return (data_step, batch, loss_scale), self.snapshot_workers(self.group.actors) if snapshot else None

    def finish_step(self, submitted: tuple[int, Any, Any]) -> Any:
        return self.run_step(*submitted)

    def run_step(self, data_step: int, batch: Any, loss_scale: Any) -> Any:
        if self.fail_next:
            raise WorkersFailed(data_step, self.fail_next.pop(0))
        self.steps_run.append(data_step)
        for actor in self.group.actors:  # every worker's state ended the step
            actor.committed_steps.answer = len(self.steps_run)
        report = StageReport([], types.SimpleNamespace(), None, commits=len(self.steps_run))
        return types.SimpleNamespace(decision=None, reports=[report] * len(self.group.actors))

    def snapshot_workers(self, actors: list) -> SnapshotTasks:
        return SnapshotTasks([actor.snapshot.remote() for actor in actors])

    def drain(self, failed: Any) -> dict:
        return {}

    def reconnect(self, survivors: list) -> None:
        pass

    def relayout(self, survivors: list) -> None:
        pass

    def before_next_step(self, actors: list) -> None:
        pass

    def get(self, refs: list) -> list:
        return refs

    def wait(self, refs: list) -> None:
        pass

    def get_watched(self, refs: list) -> list:
        return refs


FAKE_RAY = types.SimpleNamespace(get=lambda refs, timeout=None: refs, kill=lambda actor: None,
                                 wait=lambda refs, num_returns=1, timeout=None, fetch_local=True: (list(refs), []),
                                 exceptions=ray.exceptions)


class FakePlacement:
    def ready(self) -> str:
        return "placed"


@pytest.fixture
def fake_cluster(monkeypatch):
    """The controller's Ray-facing collaborators, fabricated: every Ray call answers at once."""
    FakeGroup.no_room = False
    fake_cluster = types.SimpleNamespace(
        connect=lambda address, cpus: None, resolve_use_gpu=lambda config: False, num_alive_nodes=lambda: 1,
        worker_bundle=lambda config, use_gpu: {"CPU": 1.0}, worker_memory_bytes=lambda device_memory: 2**40,
        stage_bundle=cluster.stage_bundle, placeable_workers=lambda bundle, freed=(): len(freed),
        release=lambda groups: None, reserve_between=lambda low, high, bundles, timeout: ([FakePlacement()] * high, []))
    fake_spread = types.SimpleNamespace(replica_group=lambda bundles: FakePlacement(),
                                        relocate=lambda placement, bundles, nodes: placement)
    monkeypatch.setattr(controller_module, "cluster", fake_cluster)
    monkeypatch.setattr(partitioning_module, "cluster", fake_cluster)
    monkeypatch.setattr(elastic, "cluster", fake_cluster)
    monkeypatch.setattr(controller_module, "StageGroup", FakeGroup)
    monkeypatch.setattr(controller_module, "make_executor", FakeExecutor)
    monkeypatch.setattr(controller_module, "ray", FAKE_RAY)
    for module in (snapshots, state_transfer, elastic, partitioning_module, health):
        monkeypatch.setattr(module, "ray", FAKE_RAY)
    monkeypatch.setattr(elastic, "spread", fake_spread)
    monkeypatch.setattr(partitioning_module, "spread", fake_spread)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("the test started Ray"))
    monkeypatch.setattr(elastic, "ResourceRequest", lambda bundles: types.SimpleNamespace(
        request=lambda count: None, withdraw=lambda: None))


@pytest.fixture(scope="module")
def exporter():
    """One for the module (closing one waits for its server's poll); each controller records its state anew."""
    with MetricsExporter() as exporter:
        yield exporter


def controller_for(exporter: MetricsExporter, **options: Any) -> Controller:
    config = PipelineConfig(**{"num_stages": 2, "num_micro_batches": 2, "snapshot_every": 1, **options})
    layers = tuple(nn.Linear(4, 4) for _ in range(4))
    return Controller(config, [2, 2], StageModel(layers, None, nn.functional.mse_loss, None, len),
                      metrics=exporter)


def gauge(exporter: MetricsExporter) -> dict[str, float]:
    """The exported ``raypipe_controller_state``, read back from the registry."""
    return {sample.labels["state"]: sample.value for family in exporter.registry.collect()
            for sample in family.samples if sample.name == "raypipe_controller_state"}


def transitions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == "raypipe" and record.getMessage().startswith("controller ")]


def current(exporter: MetricsExporter) -> str:
    values = gauge(exporter)
    assert sorted(values) == sorted(STATES) and sorted(values.values()) == [0.0] * (len(STATES) - 1) + [1.0]
    return next(state for state, value in values.items() if value == 1.0)


def test_start_runs_and_shutdown_stops(fake_cluster, exporter, caplog) -> None:
    caplog.set_level(logging.INFO, logger="raypipe")
    controller = controller_for(exporter)
    assert controller.state is ControllerState.STARTING and current(exporter) == "starting"
    controller.start()
    assert current(exporter) == "running"
    controller.run_step(0, None, None)
    layout = controller.layout
    assert isinstance(layout, Layout) and layout.topology.world_size == 2 and layout.balance == (2, 2)
    assert not layout.repartitioned and len(layout.first_replica) == 2
    with pytest.raises(AttributeError):  # frozen: read it, change the layout through the controller
        layout.balance = (4,)
    controller.stop()
    assert current(exporter) == "stopped"
    assert transitions(caplog) == ["controller starting -> running (placed; 1 replica(s) of 2 stage(s))",
                                   "controller running -> stopped (shutdown)"]


def test_a_heal_goes_through_healing_and_back_to_running(fake_cluster, exporter, caplog) -> None:
    caplog.set_level(logging.INFO, logger="raypipe")
    controller = controller_for(exporter, num_replicas=2)
    controller.start()
    controller.run_step(0, None, None)
    controller.committed(1, snapshots.LoggedStep(0, None, None))
    seen = []
    controller.executor.fail_next = [{(1, 1): "died"}]
    original = controller._heal
    controller._heal = lambda healing: (seen.append(current(exporter)), original(healing))[1]
    controller.run_step(1, None, None)
    assert seen == ["healing"] and current(exporter) == "running"
    assert controller.executor.group.killed == [3]
    assert [recovered.source for recovered in controller.recoveries] == ["replica 0"]  # a sibling had it
    assert transitions(caplog)[1:] == [
        "controller running -> healing (replica 1 stage 1 died)",
        "controller healing -> running (healed from the replica 0; 2 replica(s) of 2 stage(s))"]


def test_the_heal_under_way_is_a_state_that_carries_its_data(fake_cluster, exporter) -> None:
    controller = controller_for(exporter, num_replicas=2)
    controller.start()
    controller.run_step(0, None, None)
    controller.committed(1, snapshots.LoggedStep(0, None, None))
    seen = []
    original = controller._heal
    controller._heal = lambda healing: (seen.append((healing, controller.current_state)), original(healing))[1]
    controller.executor.fail_next = [{(1, 1): "died"}]
    controller.run_step(1, None, None)
    [(healing, current)] = seen
    assert current is healing and isinstance(healing, Healing) and healing.kind is ControllerState.HEALING
    assert dict(healing.failed) == {3: "died"} and healing.reasons == {"died"} and healing.relayout is None
    assert isinstance(controller.current_state, Running) and controller.state is ControllerState.RUNNING
    with pytest.raises(AttributeError):  # frozen: the controller enters a new state, it changes none
        healing.relayout = "shrink"


def test_a_second_failure_during_the_heal_is_the_same_heal(fake_cluster, exporter, caplog) -> None:
    caplog.set_level(logging.INFO, logger="raypipe")
    controller = controller_for(exporter, snapshot_every=2)
    controller.start()
    controller.run_step(0, None, None)
    controller.committed(1, snapshots.LoggedStep(0, None, None))  # logged for replay: no snapshot due yet
    controller.executor.fail_next = [{(0, 0): "died"}, {(0, 1): "hung"}]
    controller.run_step(1, None, None)  # the heal's replay of step 0 meets the second failure
    assert controller.executor.steps_run == [0, 0, 1]
    assert transitions(caplog)[1:] == [
        "controller running -> healing (replica 0 stage 0 died)",
        "controller healing -> running (healed from the snapshot of step 0; 1 replica(s) of 2 stage(s))"]
    assert len(controller.failures) == 2 and len(controller.recoveries) == 1


def test_a_shrink_goes_through_resizing(fake_cluster, exporter, caplog) -> None:
    caplog.set_level(logging.INFO, logger="raypipe")
    controller = controller_for(exporter, num_replicas=(1, 2))
    controller.start()
    FakeGroup.no_room = True
    controller.executor.fail_next = [{(1, 0): "died"}]
    controller.run_step(0, None, None)
    assert controller.layout.topology.num_replicas == 1 and current(exporter) == "running"
    assert controller.resizes == [(0, "shrink", 1)]
    assert transitions(caplog)[1:] == [
        "controller running -> healing (replica 1 stage 0 died)",
        "controller healing -> resizing (shrink to 1 replica(s))",
        "controller resizing -> running (healed from the snapshot of step 0; 1 replica(s) of 2 stage(s))"]


def test_a_grow_goes_through_resizing(fake_cluster, exporter, caplog, monkeypatch) -> None:
    caplog.set_level(logging.INFO, logger="raypipe")
    controller = controller_for(exporter, num_replicas=(1, 2))
    monkeypatch.setattr(controller_module.cluster, "reserve_between",
                        lambda low, high, bundles, timeout: ([FakePlacement()], [FakePlacement()]))
    controller.start()
    assert controller.layout.topology.num_replicas == 1
    controller.run_step(0, None, None)  # the pending placement group is placed: its workers start
    assert current(exporter) == "running"
    controller.run_step(1, None, None)  # ready: admitted at the step boundary
    assert controller.layout.topology.num_replicas == 2 and len(controller.layout.actors) == 4
    assert current(exporter) == "running" and controller.resizes == [(0, "grow", 2)]
    assert transitions(caplog)[1:] == ["controller running -> resizing (grow to 2 replica(s))",
                                       "controller resizing -> running (grew; 2 replica(s) of 2 stage(s))"]


def test_a_repartition_and_the_way_back(fake_cluster, exporter, caplog) -> None:
    caplog.set_level(logging.INFO, logger="raypipe")
    controller = controller_for(exporter)
    controller.start()
    FakeGroup.no_room = True
    controller.executor.fail_next = [{(0, 1): "died"}]
    controller.run_step(0, None, None)
    layout = controller.layout
    assert layout.repartitioned and layout.balance == (4,) and layout.config.num_stages == 1
    assert controller.executor.config is layout.config  # the executor's copy follows the one in force
    assert current(exporter) == "repartitioned" and controller.partition_return is not None
    assert transitions(caplog)[1:] == [
        "controller running -> healing (replica 0 stage 1 died)",
        "controller healing -> repartitioned (re-partitioned from 2 to 1 stage(s): no room for a whole pipeline)"]
    # the configured pipeline's workers are ready beside: they take over at the next step boundary
    configured = FakeGroup(object, controller.stage_specs(*controller.configured))
    controller.partition_return.close()
    controller.partition_return = types.SimpleNamespace(
        poll=lambda: configured, started=True, in_place=False, num_stages=2, take_over=lambda running: configured,
        close=lambda: None)
    controller.run_step(1, None, None)
    assert controller.layout.balance == (2, 2) and controller.group is configured and current(exporter) == "running"
    assert [direction for _, direction, _ in controller.resizes] == ["repartition", "restore"]
    assert transitions(caplog)[3:] == [
        "controller repartitioned -> resizing (back to the configured 2 stage(s) beside)",
        "controller resizing -> running (the configured stages took over; 1 replica(s) of 2 stage(s))"]


def test_a_failure_that_cannot_be_healed_ends_in_failed(fake_cluster, exporter, caplog) -> None:
    caplog.set_level(logging.INFO, logger="raypipe")
    controller = controller_for(exporter, max_failures=1)
    controller.start()
    controller.executor.fail_next = [{(0, 0): "died"}, {(0, 0): "died"}]
    with pytest.raises(TooManyFailures):
        controller.run_step(0, None, None)
    assert current(exporter) == "failed"
    assert transitions(caplog)[-2:] == [  # the policy raised before a second heal began
        "controller healing -> running (healed from the snapshot of step 0; 1 replica(s) of 2 stage(s))",
        "controller running -> failed (2 failures, more than max_failures=1; training stopped (load_checkpoint "
        "resumes from the newest intact checkpoint))"]
    controller.stop()
    assert current(exporter) == "stopped"


def test_the_gauge_is_absent_until_a_controller_exports_it_and_bad_states_are_rejected() -> None:
    with MetricsExporter() as exporter:
        assert gauge(exporter) == {}
        with pytest.raises(ValueError, match="'lost' is not one of"):
            exporter.record_controller_state("lost", STATES)
        assert gauge(exporter) == {}


def test_survivors_asked_whether_they_ended_the_step_answer_within_the_hang_timeout_or_all_count(monkeypatch) -> None:
    """A survivor that never answers (SIGSTOPped in the step after a kill: not among the failed yet)
    must not hold the heal: the question waits ``hang_timeout_s`` at most, then every survivor counts
    as having ended the step, so the snapshot path rolls all back (and its calls find the hung one)."""
    asked: list[float | None] = []

    def hung_get(refs, timeout=None):
        asked.append(timeout)
        raise ray.exceptions.GetTimeoutError("a survivor did not answer")

    monkeypatch.setattr(state_transfer.ray, "get", hung_get)
    actors = [types.SimpleNamespace(committed_steps=types.SimpleNamespace(remote=lambda: None)) for _ in range(4)]
    assert state_transfer.survivors_that_ended(actors, [1], commits=3, timeout_s=5.0) == frozenset({0, 2, 3})
    assert asked == [5.0]
