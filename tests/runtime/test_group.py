"""StageGroup: created from frozen specs, waited for, polled, partly replaced, shut down."""
import os
import time

import pytest
import ray
import torch
from torch import nn

import raypipe
from raypipe.runtime.actor_classes import worker_actor_class
from raypipe.runtime.group import StageGroup
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker


def specs(num_stages=2):
    config = raypipe.PipelineConfig(num_stages=num_stages)
    return [WorkerSpec(stage, num_stages, (raypipe.LayerSpec(nn.Linear, 4, 4),), (stage,), config,
                       optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1),
                       loss_fn=nn.functional.mse_loss if stage == num_stages - 1 else None)
            for stage in range(num_stages)]


@pytest.mark.cluster
def test_a_dead_worker_is_found_and_replaced_from_its_spec(ray_cluster):
    group = StageGroup(worker_actor_class(StageWorker), specs(), {"CPU": 1.0}, placement_timeout_s=30)
    try:
        infos = group.wait_ready(timeout_s=60)
        assert [info["num_parameters"] for info in infos] == [20, 20]
        workers = group.workers
        assert [(w.replica, w.stage) for w in workers] == [(0, 0), (0, 1)]
        assert all(w.node_id == ray.get_runtime_context().get_node_id() for w in workers)
        assert len({w.pid for w in workers}) == 2 and os.getpid() not in {w.pid for w in workers}
        assert group.poll() == []

        original = ray.get(group.actors[1].state_dict.remote())
        ray.kill(group.actors[1])  # asynchronous: the actor dies shortly after
        deadline = time.monotonic() + 30
        while group.poll() != [1]:
            assert time.monotonic() < deadline, "the killed worker still answers"
        with pytest.raises(ray.exceptions.RayActorError) as error:
            ray.get(group.actors[1].ready.remote())
        assert group.index_of(error.value) == 1

        group.replace([1], timeout_s=60)
        assert group.poll() == []
        assert group.workers[1].pid != workers[1].pid
        # the spec is frozen: the replacement builds the same layer (seeded by its global index)
        rebuilt = ray.get(group.actors[1].state_dict.remote())
        assert torch.equal(rebuilt[1]["weight"], original[1]["weight"])
    finally:
        group.shutdown()
    assert group.actors == []
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
