"""Compound faults, injected deterministically: a worker lost while the run is already
changing its layout (a heal, a replacement starting, a shrink, a grow's admission, a
partition swap beside or in place, a background checkpoint write, an evaluation, the
snapshot copy) is healed, never surfaces as a raw Ray error.

The real controller and its mechanisms (resizer, partitioning, state transfer) run
over fabricated workers (:mod:`raypipe.testing.fault_injection`, no Ray): a scripted
:class:`Fault` kills workers at a chosen call. The reference is independent of the
mechanisms: a run without failures commits data steps 0, 1, ..., n-1 on every worker,
so after the faulted run every worker's history must be exactly that.
"""
from __future__ import annotations

from typing import Any

import pytest
import ray
from torch import nn

from raypipe.config import PipelineConfig
from raypipe.control import controller as controller_module
from raypipe.control import partitioning as partitioning_module
from raypipe.control.controller import Controller, ControllerState, StageModel
from raypipe.control import compound, elastic
from raypipe.control.snapshots import LoggedStep
from raypipe.errors import WorkersFailed, WorkersLost
from raypipe.testing.fault_injection import (CALLER, FakeExecutor, FakeGroup, FakePlacement, FakeRay, Fault,
                                             Slowdown, fake_cluster, fake_resource_request, fake_spread)


@pytest.fixture
def fake_ray(monkeypatch) -> FakeRay:
    """The fakes in the place of Ray, the cluster and the worker groups."""
    fake = FakeRay()
    fake.install(monkeypatch.setattr)
    monkeypatch.setattr(FakeGroup, "fake_ray", fake)
    monkeypatch.setattr(FakeGroup, "no_room", 0)
    monkeypatch.setattr(FakeGroup, "spares_up", 0)
    monkeypatch.setattr(FakePlacement, "condition", lambda: True)
    cluster = fake_cluster()
    for module in (controller_module, partitioning_module, elastic):
        monkeypatch.setattr(module, "cluster", cluster)
    for module in (elastic, partitioning_module):
        monkeypatch.setattr(module, "spread", fake_spread())
    monkeypatch.setattr(controller_module, "StageGroup", FakeGroup)
    monkeypatch.setattr(partitioning_module, "StageGroup", FakeGroup)
    monkeypatch.setattr(controller_module, "make_executor", FakeExecutor)
    monkeypatch.setattr(elastic, "ResourceRequest", fake_resource_request)
    monkeypatch.setattr(compound, "RETRY_PAUSE_S", 0.0)
    fake.decisions = []  # every failure decision the controller asked for, in order (it alone asks)
    monkeypatch.setattr(controller_module, "decide_failure",
                        recorded(controller_module.decide_failure, fake.decisions))
    return fake


def recorded(decide: Any, decisions: list) -> Any:
    def deciding(view: Any) -> Any:
        decisions.append(decide(view))
        return decisions[-1]

    return deciding


def decided(fake_ray: FakeRay) -> list[str]:
    """The decisions taken, by kind, repeats of the same one in a row once."""
    kinds = [type(decision).__name__ for decision in fake_ray.decisions]
    return [kind for position, kind in enumerate(kinds) if position == 0 or kinds[position - 1] != kind]


def controller_for(balance: tuple[int, ...] = (2, 2), **options: Any) -> Controller:
    config = PipelineConfig(**{"num_stages": 2, "num_micro_batches": 2, "snapshot_every": 1,
                               "max_failures": None, "hang_timeout_s": 1.0, **options})
    layers = tuple(nn.Linear(4, 4) for _ in range(4))
    return Controller(config, list(balance), StageModel(layers, None, nn.functional.mse_loss, None, len))


def run(controller: Controller, steps: range) -> None:
    """As the trainer runs steps: each one, then its commit logged."""
    for step in steps:
        controller.run_step(step, None, None)
        controller.committed(step + 1, LoggedStep(step, None, None))


def histories(controller: Controller) -> set[tuple[int, ...]]:
    return {actor.steps for actor in controller.layout.actors}


def arm(fake_ray: FakeRay, *faults: Fault) -> None:
    """From now on (calls before do not count)."""
    fake_ray.faults[:] = faults


def assert_healed(controller: Controller, steps: int, recoveries: int = 1) -> None:
    assert all(fault.fired for fault in FakeGroup.fake_ray.faults)  # each scripted fault happened
    assert histories(controller) == {tuple(range(steps))}  # every worker as in a run without failures
    assert controller.state in (ControllerState.RUNNING, ControllerState.REPARTITIONED)
    assert len(controller.recoveries) == recoveries and controller.executor.usable


def test_a_second_worker_lost_while_the_snapshot_is_restored_is_the_same_heal(fake_ray) -> None:
    controller = controller_for()
    controller.start()
    run(controller, range(2))
    arm(fake_ray, Fault("run_step", kill=[(0, 0)]), Fault("restore", kill=[(0, 1)]))
    run(controller, range(2, 4))
    assert_healed(controller, 4)
    assert len(controller.failures) == 2 and controller.recoveries[0].source.startswith("snapshot of step 2")
    # the second failure: both replaced, and every worker restored again
    assert decided(fake_ray) == ['ReplaceWorkers', 'RestoreSnapshot', 'ReplaceWorkers', 'RestoreSnapshot']


def test_a_sibling_lost_while_it_gives_its_state_is_the_same_heal(fake_ray) -> None:
    controller = controller_for(num_replicas=2)
    controller.start()
    run(controller, range(1))
    arm(fake_ray, Fault("run_step", kill=[(1, 1)]), Fault("abort_step", kill=[(0, 0)]))
    run(controller, range(1, 3))
    assert_healed(controller, 3)
    assert len(controller.failures) == 2
    assert decided(fake_ray) == ['ReplaceWorkers', 'CopyFromSiblings', 'ReplaceWorkers', 'CopyFromSiblings']


@pytest.mark.parametrize("during", ["leave_group", "join_group", "committed_steps"])
def test_a_worker_lost_while_the_group_is_formed_again_is_the_same_heal(fake_ray, during) -> None:
    controller = controller_for(num_replicas=2)
    controller.start()
    run(controller, range(1))
    arm(fake_ray, Fault("run_step", kill=[(0, 1)]), Fault(during, kill=[(1, 0)]))
    run(controller, range(1, 3))
    assert_healed(controller, 3)
    # both replicas lost a worker: only a sibling of each (the other replica's survivor) can give state
    assert decided(fake_ray)[-2:] == ["ReplaceWorkers", "CopyFromSiblings"]


def test_a_tensor_parallel_rank_heals_from_the_same_shard_of_a_sibling_and_a_lost_stage_from_snapshots(
        fake_ray) -> None:
    """t = 2: workers are (replica, stage, tp_rank). A rank lost with the replicas holding copies
    copies the same (stage, tp_rank) of the other replica; then both ranks of a stage (what a lost
    node takes) lost in a run of one replica, and the second during the restore, roll every worker
    back to the snapshot."""
    controller = controller_for(num_replicas=2, tensor_parallel=2)
    controller.start()
    assert len(controller.layout.actors) == 8
    run(controller, range(1))
    arm(fake_ray, Fault("run_step", kill=[(1, 1, 1)]))
    run(controller, range(1, 3))
    assert_healed(controller, 3)
    assert fake_ray.decisions[-1].sources == ((7, 3),)  # replica 1 stage 1 tp_rank 1 <- replica 0's
    assert "replica 1 stage 1 tp_rank 1 died" in controller.failures[0]

    single = controller_for(tensor_parallel=2)
    single.start()
    run(single, range(2))
    arm(fake_ray, Fault("run_step", kill=[(0, 1, 0), (0, 1, 1)]), Fault("restore", kill=[(0, 0, 1)]))
    run(single, range(2, 4))
    assert_healed(single, 4)
    assert decided(fake_ray)[-4:] == ['ReplaceWorkers', 'RestoreSnapshot', 'ReplaceWorkers', 'RestoreSnapshot']


def test_a_worker_lost_during_the_replay_is_the_same_heal(fake_ray) -> None:
    controller = controller_for(snapshot_every=3)
    controller.start()
    run(controller, range(2))
    arm(fake_ray, Fault("run_step", kill=[(0, 1)]), Fault("run_step", kill=[(0, 0)], nth=4))
    run(controller, range(2, 4))
    assert_healed(controller, 4)
    assert controller.recoveries[0].replayed_steps == 2
    assert decided(fake_ray) == ['ReplaceWorkers', 'RestoreSnapshot', 'ReplaceWorkers', 'RestoreSnapshot']


def test_a_replacement_that_dies_while_it_starts_is_started_again(fake_ray) -> None:
    """A lost node's bundle not re-placed yet: its replacements die at start, twice."""
    controller = controller_for()
    controller.start()
    run(controller, range(1))
    arm(fake_ray, Fault("run_step", kill=[(0, 0)]), Fault("ready", kill=CALLER, times=2))
    run(controller, range(1, 3))
    assert_healed(controller, 3)
    assert controller.group.replaced == [0, 0, 0]  # twice dead at start, then up
    assert len(controller.failures) == 1  # one failure event, not three
    assert decided(fake_ray) == ['ReplaceWorkers', 'RestoreSnapshot']


def test_replacements_dying_past_replace_timeout_go_to_the_policy(fake_ray) -> None:
    """Never up within replace_timeout_s: as if no room, so the policy re-partitions."""
    controller = controller_for(replace_timeout_s=0.0)
    controller.start()
    run(controller, range(1))
    arm(fake_ray, Fault("run_step", kill=[(0, 0)]), Fault("ready", kill=CALLER, times=1))
    run(controller, range(1, 3))
    assert_healed(controller, 3)
    assert controller.layout.repartitioned and controller.state is ControllerState.REPARTITIONED
    assert decided(fake_ray) == ['ReplaceWorkers', 'WaitForRoom', 'Repartition', 'RestoreSnapshot']


@pytest.mark.parametrize("chunks", [{}, {"balance": (1, 1, 1, 1), "schedule": "zbv", "virtual_stages": 2}],
                         ids=["one-chunk", "zbv"])
def test_a_worker_lost_during_a_shrink_is_the_same_heal(fake_ray, chunks) -> None:
    controller = controller_for(num_replicas=(1, 2), **chunks)
    controller.start()
    run(controller, range(1))
    FakeGroup.no_room = 1  # replica 1's replacement finds no room: shrink
    arm(fake_ray, Fault("run_step", kill=[(1, 0)]), Fault("take_layout", kill=[(0, 1)]))
    run(controller, range(1, 3))
    assert_healed(controller, 3)
    assert controller.layout.topology.num_replicas == 1 and [d for _, d, _ in controller.resizes] == ["shrink"]
    assert decided(fake_ray) == ['ReplaceWorkers', 'Shrink', 'ReplaceWorkers', 'RestoreSnapshot']


@pytest.mark.parametrize("fault, heals", [
    (Fault("restore", kill=[(0, 1)]), 1),  # before the new replica joined: it is asked for again
    (Fault("take_layout", kill=[(0, 1)]), 1),  # while every worker takes the grown layout: the grow is undone
    (Fault("take_layout", kill=CALLER, nth=3), 0),  # a worker of the new replica, then: undone, nothing to heal
])
def test_a_worker_lost_during_a_grows_admission_is_healed(fake_ray, monkeypatch, fault, heals) -> None:
    monkeypatch.setattr(controller_module, "cluster", fake_cluster(num_replicas_placed=1))
    controller = controller_for(num_replicas=(1, 2))
    controller.start()
    run(controller, range(1))  # the pending replica starts at the first step boundary, joins at the second
    arm(fake_ray, fault)
    run(controller, range(1, 6))  # asked for again, it starts and joins
    assert fault.fired == 1
    assert_healed(controller, 6, recoveries=heals)
    assert decided(fake_ray) == ["ReplaceWorkers", "RestoreSnapshot"] * heals
    assert controller.layout.topology.num_replicas == 2 and controller.state is ControllerState.RUNNING
    assert [direction for _, direction, _ in controller.resizes] == ["grow"]


def test_an_old_worker_named_lost_as_a_grow_forms_its_group_goes_to_the_heal_at_once(fake_ray, monkeypatch) -> None:
    """The grown group's formation fails naming an old worker lost (one held in torch's group formation
    by a lost peer is alive: its next call would queue behind that join until ``p2p_timeout_s``): the
    grow is undone without forming the old layout's group with it first, the heal replaces it, and the
    replica asked for again joins later."""
    monkeypatch.setattr(controller_module, "cluster", fake_cluster(num_replicas_placed=1))
    controller = controller_for(num_replicas=(1, 2))
    controller.start()
    run(controller, range(1))  # the pending replica starts at the first step boundary, joins at the second
    relayouts, original = [], FakeExecutor.relayout

    def relayout(executor: FakeExecutor, survivors: list) -> None:
        relayouts.append(len(executor.group.actors))
        if len(relayouts) == 1:  # the grown layout's group: old rank 1 held in its formation
            raise WorkersLost({1: "hung"})
        original(executor, survivors)

    monkeypatch.setattr(FakeExecutor, "relayout", relayout)
    run(controller, range(1, 6))
    assert relayouts[0] == 4 and relayouts[1:2] == [2]  # the heal's, on the old layout, once rank 1 was replaced
    assert_healed(controller, 6)
    assert "replica 0 stage 1 hung" in controller.failures[0], controller.failures
    assert decided(fake_ray) == ["ReplaceWorkers", "RestoreSnapshot"]
    assert controller.layout.topology.num_replicas == 2 and [d for _, d, _ in controller.resizes] == ["grow"]


@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["copies", "zero1"])
def test_an_elastic_run_at_t2_shrinks_and_grows_in_whole_replicas(fake_ray, monkeypatch, shard_optimizer) -> None:
    """t = 2: a replica is its p x t workers. One rank's replacement finds no room: its replica is
    dropped (with ZeRO-1 every worker adopts its (stage, tp_rank)'s parts of both old replicas),
    and a placed replica joins again, 4 workers at once; a worker lost during the shrink is healed."""
    monkeypatch.setattr(controller_module, "cluster", fake_cluster(num_replicas_placed=2))
    controller = controller_for(num_replicas=(1, 2), tensor_parallel=2, shard_optimizer=shard_optimizer)
    controller.start()
    run(controller, range(1))
    assert len(controller.layout.actors) == 8
    FakeGroup.no_room = 1
    arm(fake_ray, Fault("run_step", kill=[(1, 0, 1)]), Fault("take_layout", kill=[(0, 1, 1)]))
    run(controller, range(1, 3))
    assert len(controller.layout.actors) == 4 and controller.layout.topology.num_replicas == 1
    assert decided(fake_ray)[:2] == ['ReplaceWorkers', 'Shrink']
    adopted = [name for name, method in fake_ray.calls if method == "adopt"]
    assert len(adopted) == (4 if shard_optimizer else 0)  # each of the 4 workers once, from both replicas
    run(controller, range(3, 8))  # the replica asked for again is placed, starts and joins
    assert_healed(controller, 8)
    assert len(controller.layout.actors) == 8 and [d for _, d, _ in controller.resizes] == ["shrink", "grow"]
    assert [(w.replica, w.stage, w.tp_rank) for w in controller.layout.workers] == [
        (r, s, t) for r in range(2) for s in range(2) for t in range(2)]


def repartitioned(fake_ray: FakeRay, **options: Any) -> Controller:
    """A one-replica run re-partitioned onto 1 stage (no room to replace its stage 1)."""
    controller = controller_for(**options)
    controller.start()
    run(controller, range(1))
    FakeGroup.no_room = 1
    arm(fake_ray, Fault("run_step", kill=[(0, 1)]))
    run(controller, range(1, 2))
    assert controller.layout.repartitioned
    return controller


@pytest.mark.parametrize("fault, heals", [
    (Fault("adopt", kill=CALLER), 0),  # a new worker, while it adopts the running ones' layers
    (Fault("snapshot", kill=CALLER, on=(0, 0), nth=2), 1),  # the running worker, while it is snapshotted for them
])
def test_a_worker_lost_during_a_swap_beside_is_healed_and_the_swap_comes_again(fake_ray, fault, heals) -> None:
    controller = repartitioned(fake_ray)
    arm(fake_ray, fault)
    run(controller, range(2, 6))
    assert not controller.layout.repartitioned and controller.state is ControllerState.RUNNING
    assert fault.fired == 1
    assert_healed(controller, 6, recoveries=1 + heals)


def test_a_run_of_model_chunks_re_partitions_onto_a_schedule_of_one_chunk_says_so_and_comes_back(
        fake_ray, caplog) -> None:
    """zbv (two chunks a worker, in a V) on 2 workers loses one with no room for its replacement: the one
    stage left runs 1f1b (zbv's v=2 chunks of 4 layers would fit, but 1f1b runs on any stage count and m),
    the log line names it; back on zbv's configured 2 x 2 chunks once there is room."""
    caplog.set_level("INFO", logger="raypipe")
    controller = repartitioned(fake_ray, balance=(1, 1, 1, 1), schedule="zbv", virtual_stages=2)
    config = controller.config
    assert (config.num_stages, config.schedule, config.virtual_stages, controller.balance) == (1, "1f1b", 1, [4])
    assert "re-partitioned from 2 to 1 stage(s) (layers per stage [4], schedule 1f1b)" in caplog.text
    assert [spec.layer_indices for spec in controller.stage_specs(*controller.configured)] == [(0, 3), (1, 2)]
    run(controller, range(2, 6))
    assert not controller.layout.repartitioned and controller.config.schedule == "zbv"
    assert histories(controller) == {tuple(range(6))} and controller.executor.usable


def test_a_new_worker_lost_during_a_swap_in_place_is_healed(fake_ray, monkeypatch) -> None:
    controller = repartitioned(fake_ray)
    # no room beside: the configured pipeline is placed only once the running workers went
    monkeypatch.setattr(FakePlacement, "condition", lambda: controller.group is None)
    monkeypatch.setattr(partitioning_module.cluster, "placeable_workers", lambda bundle, freed=(): 2 * len(freed))
    arm(fake_ray, Fault("adopt", kill=[(0, 1)]))
    run(controller, range(2, 5))
    assert_healed(controller, 5, recoveries=2)
    assert decided(fake_ray)[-2:] == ['ReplaceWorkers', 'RestoreSnapshot']  # the new workers adopt the snapshot again


def test_a_new_worker_lost_during_a_swap_in_place_with_no_room_for_its_replacement_re_partitions_again(
        fake_ray, monkeypatch) -> None:
    """The real-process run's case on a loaded machine: the new stage 1 is lost as it adopts, and its
    replacement finds no room. The policy re-partitions, from the new partition's figures (the last
    step's reports are of the stage that went: reading them raised ValueError from zip)."""
    controller = repartitioned(fake_ray)
    monkeypatch.setattr(FakePlacement, "condition", lambda: controller.group is None)
    monkeypatch.setattr(partitioning_module.cluster, "placeable_workers", lambda bundle, freed=(): 2 * len(freed))
    arm(fake_ray, Fault("adopt", kill=[(0, 1)]))
    FakeGroup.no_room = 1
    run(controller, range(2, 5))
    assert histories(controller) == {tuple(range(5))} and controller.executor.usable
    # the lost node's heal, then the swap's: re-partitioned again from the swap's own snapshot (of the one
    # stage that went, whose reports and worker count are not the configured pipeline's); then back
    assert decided(fake_ray) == ['ReplaceWorkers', 'WaitForRoom', 'Repartition', 'RestoreSnapshot'] * 2
    assert controller.recoveries[1].source == "snapshot of step 2, re-partitioned onto 1 stage(s)"
    assert not controller.layout.repartitioned  # back on the configured stages by the end


def test_a_new_worker_dying_at_start_during_a_swap_in_place_goes_on_with_fewer_stages(fake_ray, monkeypatch) -> None:
    controller = repartitioned(fake_ray)
    monkeypatch.setattr(FakePlacement, "condition", lambda: controller.group is None)
    monkeypatch.setattr(partitioning_module.cluster, "placeable_workers", lambda bundle, freed=(): 2 * len(freed))
    arm(fake_ray, Fault("ready", kill=CALLER))
    run(controller, range(2, 5))
    assert histories(controller) == {tuple(range(5))} and controller.executor.usable


def test_a_worker_lost_during_a_background_checkpoint_write_is_healed_at_the_next_step(fake_ray) -> None:
    settled = []
    controller = controller_for()
    controller.settle_saves = lambda: settled.append(True)
    controller.start()
    run(controller, range(2))
    arm(fake_ray, Fault("write_checkpoint", kill=CALLER))
    writes = [actor.write_checkpoint.remote(2) for actor in controller.layout.first_replica]
    with pytest.raises(ray.exceptions.RayActorError):  # the save learns of it (incomplete)
        ray.get(writes)
    run(controller, range(2, 4))
    assert_healed(controller, 4)
    assert decided(fake_ray) == ['ReplaceWorkers', 'RestoreSnapshot']


@pytest.mark.parametrize("also", [None, Fault("restore", kill=[(0, 0)])])
def test_a_worker_lost_during_evaluate_is_healed_and_evaluate_runs_again(fake_ray, also) -> None:
    controller = controller_for()
    controller.start()
    run(controller, range(2))
    arm(fake_ray, Fault("evaluate", kill=[(0, 1)]), *([also] if also else []))
    loss = controller.between_steps(lambda: controller.executor.evaluate(2, None), 2, "during evaluate")
    assert loss == 2.0
    run(controller, range(2, 3))
    assert_healed(controller, 3)
    assert decided(fake_ray) == ["ReplaceWorkers", "RestoreSnapshot"] * (1 if also is None else 2)


def test_a_worker_lost_during_the_snapshot_copy_heals_from_the_snapshot_before(fake_ray) -> None:
    controller = controller_for()
    controller.start()
    run(controller, range(3))
    arm(fake_ray, Fault("snapshot", kill=CALLER, on=(0, 1)))  # the copy of step 3's state, as step 3 starts
    run(controller, range(3, 5))
    assert_healed(controller, 5)
    assert controller.recoveries[0].source == "snapshot of step 2"
    last = fake_ray.decisions[-1]  # the newest snapshot lost with the worker: the one before
    assert type(last).__name__ == "RestoreSnapshot" and (last.step, last.older) == (2, True)



def test_a_slowed_worker_is_reported_once_and_the_run_goes_on_unchanged(fake_ray, caplog) -> None:
    """Replica 1's stage 0 at half speed from step 10 (slow_steps=5): found at step 14 with its node and
    factor, in one WARNING line; nothing else is found, no layout changes, every step commits as without it."""
    controller = controller_for(num_replicas=2, slow_steps=5)
    controller.start()
    controller.executor.slowdowns.append(Slowdown(on=(1, 0), from_step=10, factor=2.0))
    with caplog.at_level("WARNING", logger="raypipe"):
        run(controller, range(30))
    assert histories(controller) == {tuple(range(30))} and controller.state is ControllerState.RUNNING
    ((step, slow, node, at),) = controller.slow_workers
    assert (step, slow.worker, round(slow.factor, 6), node) == (14, (1, 0, 0), 2.0, "node")
    assert at == 14 + 0.02  # the end of its F in step 14 (the fabricated clock: a second a step, 2 x 0.01 s)
    lines = [record.getMessage() for record in caplog.records if "slow worker" in record.getMessage()]
    assert lines == ["raypipe: slow worker replica 1 stage 0 tp_rank 0 on node node: its own compute is 2.00x its "
                     "baseline, 5 steps in a row (slow_factor=1.3, on_slow='report')"]
    assert not controller.failures and not controller.resizes


def replacing_run(caplog, spares_up: int, steps: int) -> tuple[Controller, Any]:
    """on_slow="replace", (2, 2), replica 1's stage 0 slowed 2x from step 10 (found at step 14, slow_steps=5),
    ``spares_up`` warm spares up, ``steps`` steps with the WARNING lines captured: the controller and the
    slowed worker's actor. Every worker's history is whole and the run goes on."""
    controller = controller_for(num_replicas=2, slow_steps=5, on_slow="replace", spare_workers=1)
    controller.start()
    controller.executor.slowdowns.append(Slowdown(on=(1, 0), from_step=10, factor=2.0))
    FakeGroup.spares_up = spares_up
    slow_actor = controller.layout.actors[2]
    with caplog.at_level("WARNING", logger="raypipe"):
        run(controller, range(steps))
    assert histories(controller) == {tuple(range(steps))} and controller.state is ControllerState.RUNNING
    assert [(found.data_step, found.worker.worker) for found in controller.slow_workers] == [(14, (1, 0, 0))]
    return controller, slow_actor


def test_with_on_slow_replace_a_slowed_worker_is_swapped_for_a_spare_with_its_state(fake_ray, caplog) -> None:
    """on_slow="replace": found at step 14, the worker is swapped for the spare up before step 15, its
    state copied from it (no step replayed, no failure counted); its replacement is not slow, so nothing
    more is found, and every worker's history is that of a run without the slowdown."""
    controller, slow_actor = replacing_run(caplog, spares_up=1, steps=40)
    ((ranks, spares, _seconds),) = controller.slow_replaced
    assert (ranks, spares) == ((2,), {2: "spare 0"}) and not slow_actor.alive
    assert controller.layout.actors[2].steps == tuple(range(40))  # the spare went on from the slow worker's state
    assert not controller.failures and not controller.recoveries
    assert controller.executor.steps_run == list(range(40))  # nothing replayed
    assert any(record.getMessage().startswith("raypipe: swapped slow replica 1 stage 0 tp_rank 0 for spare 0 in ")
               for record in caplog.records)


def test_with_on_slow_replace_and_no_spare_up_a_slowed_worker_is_left_in_place_with_one_line_saying_why(
        fake_ray, caplog) -> None:
    """on_slow="replace" with no warm spare up: the worker found slow at step 14 stays, said once (not at
    every step it stays slow), and the run goes on as the reporting one does."""
    controller, slow_actor = replacing_run(caplog, spares_up=0, steps=30)
    assert not controller.slow_replaced and slow_actor.alive and controller.layout.actors[2] is slow_actor
    lines = [record.getMessage() for record in caplog.records if "in place" in record.getMessage()]
    assert lines == ["raypipe: on_slow='replace' leaves replica 1 stage 0 in place: no warm spare is up to take a "
                     "slow worker's place"]


def test_at_t2_a_stage_slowed_alike_is_swapped_whole_for_a_spare_group_with_each_ranks_state(fake_ray, caplog
                                                                                              ) -> None:
    """(2, 2, 2), on_slow="replace", one spare group of 2: replica 0's stage 1 slowed 2x on both ranks
    from step 10 (a slow rank's peer waits inside its F and B: neither stands out), found whole at step
    14, and both ranks swapped for the spare group before step 15, each with its own state, nothing
    replayed; the replacements are not slow, nothing more is found."""
    controller = controller_for(num_replicas=2, tensor_parallel=2, slow_steps=5, on_slow="replace",
                                spare_workers=2)
    controller.start()
    for tp_rank in range(2):
        controller.executor.slowdowns.append(Slowdown(on=(0, 1, tp_rank), from_step=10, factor=2.0))
    FakeGroup.spares_up = 1  # one group of 2 (the pool counts groups at t > 1)
    slow_actors = controller.layout.actors[2:4]
    with caplog.at_level("WARNING", logger="raypipe"):
        run(controller, range(30))
    assert histories(controller) == {tuple(range(30))} and controller.state is ControllerState.RUNNING
    assert [(found.data_step, found.worker.worker) for found in controller.slow_workers] == [(14, (0, 1, 0)),
                                                                                            (14, (0, 1, 1))]
    ((ranks, spares, _seconds),) = controller.slow_replaced
    assert (ranks, spares) == ((2, 3), {2: "spare 0", 3: "spare 0"}) and not any(a.alive for a in slow_actors)
    assert all(actor.steps == tuple(range(30)) for actor in controller.layout.actors[2:4])  # each its own state
    assert not controller.failures and not controller.recoveries and controller.executor.steps_run == list(range(30))
    assert any(record.getMessage().startswith("raypipe: swapped slow replica 0 stage 1 tp_rank 0, replica 0 stage 1 "
                                              "tp_rank 1 for spare 0 in ") for record in caplog.records)


def test_with_on_slow_replace_and_no_spare_up_a_slowed_worker_is_only_reported(fake_ray) -> None:
    controller = controller_for(num_replicas=2, slow_steps=5, on_slow="replace", spare_workers=1)
    controller.start()
    controller.executor.slowdowns.append(Slowdown(on=(0, 1), from_step=10, factor=2.0))
    run(controller, range(30))
    assert [found.worker.worker for found in controller.slow_workers] == [(0, 1, 0)] and not controller.slow_replaced
    assert histories(controller) == {tuple(range(30))}


def rebalancing_run(steps: int, slowed: bool, **options: Any) -> Controller:
    """The acceptance's run through the fakes, with timed layers' times: p = 4, d = 2, 16 layers of 10 ms
    a micro-batch (4 a stage), m = 4, 1F1B, ``on_slow="rebalance"`` and no spare; with ``slowed``, replica
    0's stage 2 twice as slow from step 20 on, its place's cause (its device: whatever worker runs there)."""
    config = PipelineConfig(**{"num_stages": 4, "num_replicas": 2, "num_micro_batches": 4, "schedule": "1f1b",
                               "snapshot_every": 1, "on_slow": "rebalance", **options})
    layers = tuple(nn.Linear(4, 4) for _ in range(16))  # equal parameter counts: equal shares of a stage's time
    controller = Controller(config, [4, 4, 4, 4], StageModel(layers, None, nn.functional.mse_loss, None, len))
    controller.start()
    controller.executor.layer_s = (0.01,) * 16
    if slowed:  # at t > 1 every rank of the stage (a slow rank's peers wait inside their F and B)
        places = [(0, 2)] if config.tensor_parallel == 1 else [(0, 2, k) for k in range(config.tensor_parallel)]
        controller.executor.slowdowns.extend(Slowdown(on=place, from_step=20, factor=2.0, of_place=True)
                                             for place in places)
    run(controller, range(steps))
    return controller


def test_with_on_slow_rebalance_layers_move_off_the_slow_stage_and_the_step_wins_back_most_of_its_loss(
        fake_ray, caplog) -> None:
    """Issue 61's acceptance through the fault-injection harness: found at step 29 (slow_steps + 0), the
    layers are split again before step 30, the same in both replicas, away from stage 2 (its slowdown
    stays with its place, so its new worker is as slow); the state moved from a snapshot taken then (no
    step replayed, no failure charged), every worker's history that of the unslowed run; the step time
    (the 1F1B schedule's timed run) wins back at least half of what the slowdown cost (here 62%: 413 ->
    330 ms against 280 unslowed; the slowest stage 80 -> 50 ms a micro-batch against 40), and the worker
    is not found again (its baseline started again at its slow pace)."""
    unslowed = rebalancing_run(80, slowed=False)
    with caplog.at_level("WARNING", logger="raypipe"):
        controller = rebalancing_run(80, slowed=True)
    assert histories(controller) == {tuple(range(80))} and controller.state is ControllerState.RUNNING
    assert [(found.data_step, found.worker.worker) for found in controller.slow_workers] == [(29, (0, 2, 0))]
    ((data_step, decision, before, _seconds),) = controller.slow_rebalanced  # once: no rebalance in a loop
    assert (data_step, before) == (30, (4, 4, 4, 4))
    assert decision.balance == (4, 5, 2, 5) and controller.balance == [4, 5, 2, 5]  # ties: earlier stages fewer
    # a step's own compute, m = 4: 4 layers x 4 x 10 ms x 2 on the slow stage -> 5 layers x 4 x 10 ms
    assert (round(decision.before, 6), round(decision.after, 6)) == (0.32, 0.2)
    assert [spec.layer_indices for spec in controller.executor.group.specs[4:]] == [
        tuple(range(0, 4)), tuple(range(4, 9)), (9, 10), tuple(range(11, 16))]  # replica 1 alike
    assert controller.configured[1] == [4, 5, 2, 5]
    assert not controller.failures and not controller.recoveries
    assert controller.executor.steps_run == list(range(80))  # nothing replayed
    times, well = controller.executor.step_times, unslowed.executor.step_times
    lost, won = times[25] - well[25], times[25] - times[40]
    assert (round(well[25], 3), round(times[25], 3), round(times[40], 3)) == (0.28, 0.413, 0.33)
    assert lost > 0 and won >= 0.5 * lost and times[30:] == [times[30]] * 50
    assert any(record.getMessage().startswith("raypipe: rebalanced away from slow replica 0 stage 2 tp_rank 0 (2.00x): "
                                              "layers per stage [4, 4, 4, 4] -> [4, 5, 2, 5] in every replica")
               for record in caplog.records)


def test_on_slow_rebalance_leaves_the_layers_where_a_move_gains_too_little(fake_ray, caplog) -> None:
    """A stage of one layer each (p = 4, 4 layers) slowed: no split at 4 stages moves its layer: reported, the
    layers where they are, and asked once (not at every step it stays slow)."""
    config = PipelineConfig(num_stages=4, num_replicas=2, num_micro_batches=4, schedule="1f1b", on_slow="rebalance",
                            slow_steps=5)
    controller = Controller(config, [1, 1, 1, 1], StageModel(tuple(nn.Linear(4, 4) for _ in range(4)), None,
                                                             nn.functional.mse_loss, None, len))
    controller.start()
    controller.executor.slowdowns.append(Slowdown(on=(1, 1), from_step=10, factor=2.0, of_place=True))
    with caplog.at_level("WARNING", logger="raypipe"):
        run(controller, range(30))
    assert not controller.slow_rebalanced and controller.balance == [1, 1, 1, 1]
    lines = [record.getMessage() for record in caplog.records if "leaves the layers" in record.getMessage()]
    assert lines == ["raypipe: on_slow='rebalance' leaves the layers where they are: moving layers would not speed "
                     "the slowest stage by 5% (0.02s -> 0.02s predicted)"]


def test_an_elastic_run_grows_with_the_rebalanced_partition(fake_ray, monkeypatch) -> None:
    """num_replicas=(1, 2), the second replica placed at the step boundary before the slow worker is found
    (slowed from step 20, slow_steps=5: found at step 24): its workers start with the old layers, so the
    rebalance before step 25 cancels them and asks again; the replica then added is built with the new
    layers (the resizer takes the partition), and every worker's history is whole."""
    monkeypatch.setattr(controller_module, "cluster", fake_cluster(num_replicas_placed=1))
    FakePlacement.condition = lambda: False
    controller = rebalancing_run(24, slowed=True, num_replicas=(1, 2), slow_steps=5)
    FakePlacement.condition = lambda: True
    run(controller, range(24, 25))  # the boundary before step 24 starts the replica; step 24 finds the worker
    started = [actor for actor in controller.resizer._starting.actors]
    run(controller, range(25, 30))
    assert controller.balance == [4, 5, 2, 5] and controller.topology.num_replicas == 2
    assert not any(actor.alive for actor in started)  # cancelled: built with the old layers
    specs = controller.executor.group.specs
    assert [spec.layer_indices for spec in specs[4:]] == [spec.layer_indices for spec in specs[:4]]
    assert [len(spec.layer_indices) for spec in specs[:4]] == [4, 5, 2, 5]
    assert histories(controller) == {tuple(range(30))}


def test_at_t2_a_stage_with_no_room_re_partitions_keeping_t_and_comes_back(fake_ray, monkeypatch) -> None:
    """(1, 2, 2): stage 1's rank 1 lost with no room for its replacement: the run goes on with one stage of
    the same t = 2 (the room counted in whole stages' bundles), each new rank adopting the layers of its own
    tp_rank's snapshots (a rank's snapshot holds its part of each layer), and returns to 2 x 2 once there is
    room, every worker's history as without the failure."""
    from raypipe.control import snapshots as snapshots_module

    adopted: list[tuple[int, int]] = []  # (tp_rank asked for, positions of the snapshots given)
    holding = snapshots_module.holding

    def recording(refs, layers, wanted, tp_rank=0, tensor_parallel=1):
        chosen = holding(refs, layers, wanted, tp_rank, tensor_parallel)
        adopted.append((tp_rank, tuple(position for position, ref in enumerate(refs) if ref in chosen)))
        return chosen

    monkeypatch.setattr("raypipe.control.state_transfer.holding", recording)
    controller = controller_for(tensor_parallel=2)
    controller.start()
    run(controller, range(1))
    FakeGroup.no_room = 1
    arm(fake_ray, Fault("run_step", kill=[(0, 1, 1)]))
    run(controller, range(1, 2))
    assert controller.layout.repartitioned and controller.state is ControllerState.REPARTITIONED
    assert (controller.config.num_stages, controller.config.tensor_parallel, controller.balance) == (1, 2, [4])
    assert [(w.stage, w.tp_rank) for w in controller.layout.workers] == [(0, 0), (0, 1)]
    # the old ranks 0-3 are (stage 0, tp 0), (0, 1), (1, 0), (1, 1): each new rank takes both stages' of its tp_rank
    assert adopted == [(0, (0, 2)), (1, (1, 3))]
    assert decided(fake_ray) == ['ReplaceWorkers', 'WaitForRoom', 'Repartition', 'RestoreSnapshot']
    run(controller, range(2, 5))
    assert not controller.layout.repartitioned and controller.config.num_stages == 2
    assert [(w.stage, w.tp_rank) for w in controller.layout.workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert histories(controller) == {tuple(range(5))}


def test_at_t2_a_rebalance_moves_layers_off_a_slow_stage_each_rank_adopting_its_own_tp_rank(fake_ray) -> None:
    """The rebalance at t = 2 (p = 4, d = 2): replica 0's stage 2 slowed 2x on both ranks (a slow rank's peer
    waits inside its F and B) is found whole; the layers move off it in every replica as at t = 1, each new
    rank adopting its own tp_rank's snapshots, every worker's history that of the unslowed run, and the step
    wins back time."""
    controller = rebalancing_run(60, slowed=True, tensor_parallel=2)
    (rebalanced,) = controller.slow_rebalanced
    assert rebalanced.balance_before == (4, 4, 4, 4) and rebalanced.decision.balance[2] < 4
    assert {slow.worker for slow in rebalanced.decision.slowed} == {(0, 2, 0), (0, 2, 1)}
    assert controller.config.tensor_parallel == 2 and len(controller.layout.actors) == 16
    assert histories(controller) == {tuple(range(60))}
    assert not controller.failures and controller.executor.steps_run == list(range(60))
    assert controller.executor.step_times[-1] < 0.9 * max(controller.executor.step_times[20:30])


def test_workers_a_watched_wait_found_lost_are_folded_in_as_named_without_being_asked_again() -> None:
    """A wait on the workers' calls that their heartbeats cut short (WorkersLost: a stopped
    worker, found hung in hang_timeout_s) becomes the heal's failure with those workers as it
    named them; only the others are probed (none here: every worker is named, so no heartbeat
    is sent and a second hang_timeout_s is not spent on one already found hung)."""
    probed = []

    def probe(detail: str, known: dict[int, str]) -> Any:
        probed.append((detail, known))
        return compound.lost_workers([object(), object(), object(), object()], 3.0, 2, 5, detail, known=known)

    with pytest.raises(WorkersFailed) as raised:
        with compound.folded(probe, "while the layout changed", lambda: True):
            raise WorkersLost({1: "hung", 0: "died", 2: "hung", 3: "unreachable"})
    assert probed == [("while the layout changed: workers found lost while the driver waited on calls to them: "
                       "rank 0 died, rank 1 hung, rank 2 hung, rank 3 unreachable",
                       {0: "died", 1: "hung", 2: "hung", 3: "unreachable"})]
    assert raised.value.step == 5
    assert raised.value.workers == {(0, 0): "died", (0, 1): "hung", (1, 0): "hung", (1, 1): "unreachable"}
