"""PartitionReturn: a re-partitioned run's configured pipeline, started beside
the running one when placed, takes over the running workers' layers (a
take-over that meets a dead worker asks again and loses nothing); where it fits
only in the running workers' room too, it is placed there once they went."""
import time

import pytest
import ray
import torch
from torch import nn

import raypipe
from raypipe.control.partitioning import PartitionReturn
from raypipe.control.policy import fits_only_in_place
from raypipe.runtime.actor_classes import worker_actor_class
from raypipe.runtime.group import StageGroup
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker

LAYERS = (raypipe.LayerSpec(nn.Linear, 4, 4), raypipe.LayerSpec(nn.Linear, 4, 4))
BUNDLE = {"CPU": 1.0}


def fits_in_place(returning: PartitionReturn, running: list) -> bool:
    """Whether the configured pipeline, not started beside, fits only in the room there is plus that of
    the ``running`` workers, as the controller asks the policy (``fits_only_in_place``)."""
    return (returning.in_place and not returning.started
            and fits_only_in_place(returning.room(running), returning.num_stages))


def specs(balance):
    """One replica's specs, ``balance`` layers a stage."""
    config = raypipe.PipelineConfig(num_stages=len(balance), balance=balance)
    starts = [sum(balance[:stage]) for stage in range(len(balance))]
    return [WorkerSpec(stage, len(balance), LAYERS[start:start + count], tuple(range(start, start + count)), config,
                       optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1),
                       loss_fn=nn.functional.mse_loss if stage == len(balance) - 1 else None)
            for stage, (start, count) in enumerate(zip(starts, balance))]


def trained_weights():
    generator = torch.Generator().manual_seed(7)  # weights no fresh build has
    return {index: {"weight": torch.randn(4, 4, generator=generator), "bias": torch.randn(4, generator=generator)}
            for index in range(2)}


def assert_adopted(group, trained):
    for stage, actor in enumerate(group.actors):
        adopted = ray.get(actor.state_dict.remote())
        assert list(adopted) == [stage]
        for name, tensor in trained[stage].items():
            assert torch.equal(adopted[stage][name], tensor), (stage, name)


def ready_group(returning, deadline_s=120):
    deadline = time.monotonic() + deadline_s
    while (group := returning.poll()) is None:
        assert time.monotonic() < deadline, "the configured pipeline never became ready"
        time.sleep(0.2)
    return group


def found_no_room(deadline_s):
    """Wait until Ray's scheduler tried the one placement group pending and found no room for it."""
    deadline = time.monotonic() + deadline_s
    while True:
        pending = [group["stats"] for group in ray.util.placement_group_table().values() if group["state"] == "PENDING"]
        if len(pending) == 1 and pending[0]["scheduling_state"] == "NO_RESOURCES":
            return
        assert time.monotonic() < deadline, f"no placement group was found without room: {pending}"
        time.sleep(0.05)


@pytest.mark.cluster
def test_the_configured_pipeline_takes_over_the_layers_and_a_dead_new_worker_is_asked_for_again(ray_cluster):
    actor_class = worker_actor_class(StageWorker)
    running = StageGroup(actor_class, specs([2]), BUNDLE, placement_timeout_s=30)  # both layers on one stage
    returning = None
    try:
        running.wait_ready(timeout_s=60)
        trained = trained_weights()
        ray.get(running.actors[0].load_state_dict.remote(trained))

        returning = PartitionReturn(actor_class, specs([1, 1]), BUNDLE)
        assert not fits_in_place(returning, running.workers)  # it fits beside: no step need wait for it
        first = ready_group(returning)
        dead_pid = ray.get(first.actors[1].ready.remote())["pid"]
        ray.kill(first.actors[1])
        assert returning.take_over(running) is None  # dropped, and asked for again
        assert first.actors == []  # its workers killed, its placement group freed

        group = ready_group(returning)
        assert dead_pid not in {info["pid"] for info in ray.get([actor.ready.remote() for actor in group.actors])}
        assert returning.take_over(running) is group
        assert_adopted(group, trained)
        returning.close()  # the group taken over keeps its placement group
        assert group.poll() == []
        group.shutdown()
    finally:
        if returning is not None:
            returning.close()
        running.shutdown()
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_where_the_configured_pipeline_fits_only_in_the_running_room_too_it_is_placed_there(ray_cluster):
    actor_class = worker_actor_class(StageWorker)
    total = ray.cluster_resources()["CPU"]
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < total:  # the workers of tests before are gone
        assert time.monotonic() < deadline, "CPUs are still held"
        time.sleep(0.2)
    # a bundle of half the CPUs: the running worker takes one, the configured pipeline needs two
    bundle = {"CPU": total / 2}
    running = StageGroup(actor_class, specs([2]), bundle, placement_timeout_s=30)
    returning = group = None
    try:
        running.wait_ready(timeout_s=60)
        trained = trained_weights()
        ray.get(running.actors[0].load_state_dict.remote(trained))
        returning = PartitionReturn(actor_class, specs([1, 1]), bundle)
        found_no_room(deadline_s=30)  # Ray tried to place its placement group (the only one pending)
        assert returning.poll() is None  # no room beside: not placed, nothing started
        assert fits_in_place(returning, running.workers)
        assert returning.start_in_place(timeout_s=1) is None  # the room is still the running worker's
        assert not returning.in_place and not fits_in_place(returning, running.workers)  # not tried again

        returning.in_place = True  # as a fresh one would be: now the running worker goes first
        snapshot = running.actors[0].snapshot.remote()
        ray.wait([snapshot], fetch_local=False)
        running.shutdown()
        group = returning.start_in_place(timeout_s=60)
        ray.get([actor.adopt.remote(snapshot) for actor in group.actors])
        assert_adopted(group, trained)
        assert group.poll() == []
    finally:
        for started in (group, running):
            if started is not None:
                started.shutdown()
        if returning is not None:
            returning.close()
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
