"""Elastic runs: between min and max replicas, the same numbers as one process
on the same global batches.

On one node here; with nodes lost and added (a multi-node
``ray.cluster_utils.Cluster``), see test_lost_nodes.py."""
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from torch import nn

import raypipe

from tests.reference import adamw, assert_mlp_run_matches_one_process, make_mlp, random_batches


def run_steps(trainer, batches, record, optimizer_bytes=None):
    for x, y in batches:
        result = trainer.step(x, y)
        record.append((result.loss, result.num_replicas))
        if optimizer_bytes is not None:
            optimizer_bytes.append({(s.replica, s.stage): s.optimizer_bytes for s in result.stages})


def test_an_elastic_run_starts_with_as_many_replicas_as_fit_and_splits_the_step_unevenly(ray_cluster):
    # 6 logical CPUs hold 3 replicas of 2 stages; the 4th stays asked for
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 4), clip_grad_norm=0.5)
    record = []
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config) as trainer:
        assert trainer.num_replicas == 3 and config.num_replicas == (1, 4)
        assert [(w.replica, w.stage) for w in trainer.workers] == [(r, s) for r in range(3) for s in range(2)]
        run_steps(trainer, random_batches(16, 3), record)  # 8 micro-batches: blocks of 3, 3 and 2
        state = trainer.state_dict()
    assert [replicas for _, replicas in record] == [3, 3, 3]
    assert_mlp_run_matches_one_process([loss for loss, _ in record], state, 16, 8, clip_grad_norm=0.5)
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


@pytest.mark.parametrize("shard_optimizer,schedule", [(False, {}), (True, {"schedule": "zbv", "virtual_stages": 2})],
                         ids=["replicated", "zero1-zbv"])
def test_a_replica_joins_when_its_resources_appear_and_takes_the_runs_state(ray_cluster, shard_optimizer, schedule):
    # replicated, the new replica copies a live one; with ZeRO-1 every worker adopts its new owners' parts (of
    # both its model chunks, under zbv)
    blocker = placement_group([{"CPU": 1.0}] * 4)  # leaves room for one replica of two stages
    ray.get(blocker.ready(), timeout=60)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 2),
                                    shard_optimizer=shard_optimizer, **schedule)
    batches, record, optimizer_bytes = random_batches(8, 40), [], []
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config) as trainer:
        assert trainer.num_replicas == 1
        run_steps(trainer, batches[:2], record, optimizer_bytes)
        remove_placement_group(blocker)
        deadline = time.monotonic() + 120
        for x, y in batches[2:]:
            run_steps(trainer, [(x, y)], record, optimizer_bytes)
            if record[-1][1] == 2 and [r for _, r in record[-2:]] == [2, 2]:
                break
            assert time.monotonic() < deadline, "the second replica never joined"
            time.sleep(0.3)  # let the new replica's workers start
        assert trainer.num_replicas == 2 and [d for _, d, _ in trainer.resizes] == ["grow"]
        assert [w.replica for w in trainer.workers] == [0, 0, 1, 1]
        state = trainer.state_dict()
    replicas = [r for _, r in record]
    assert replicas[:2] == [1, 1] and replicas[-2:] == [2, 2]
    assert_mlp_run_matches_one_process([loss for loss, _ in record], state, 8, 4)
    alone, grown = optimizer_bytes[0], optimizer_bytes[-1]
    for stage in range(2):
        parts = [grown[replica, stage] for replica in range(2)]
        if shard_optimizer:  # each parameter's moments on one replica, every replica holding a part
            assert sum(parts) == alone[0, stage] and all(0 < part < alone[0, stage] for part in parts)
        else:
            assert parts == [alone[0, stage]] * 2


def test_an_elastic_minimum_that_cannot_be_placed_is_a_clear_error(ray_cluster):
    config = raypipe.PipelineConfig(num_stages=2, num_replicas=(4, 5), placement_timeout_s=1)
    with pytest.raises(raypipe.PlacementError, match=r"could not place 4 replica\(s\) \(the elastic run's minimum\)"):
        raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config)
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())
