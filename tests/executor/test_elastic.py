"""Elastic runs: between min and max replicas, the same numbers as one process
on the same global batches.

On one node here; with nodes lost and added (a multi-node
``ray.cluster_utils.Cluster``), see test_lost_nodes.py."""
import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from torch import nn

import raypipe

from tests.reference import adamw, assert_mlp_run_matches_one_process, make_mlp, random_batches

OTHER_BATCH = random_batches(16, 1, seed=7)[0]  # evaluated after the steps, on none of theirs


def run_steps(trainer, batches, record, optimizer_bytes=None):
    for x, y in batches:
        result = trainer.step(x, y)
        record.append((result.loss, result.num_replicas))
        if optimizer_bytes is not None:
            optimizer_bytes.append({(s.replica, s.stage): s.optimizer_bytes for s in result.stages})
    return result


def blocking(num_cpus):
    """A placement group of ``num_cpus`` CPUs, placed: the room it holds is freed when it is removed."""
    blocker = placement_group([{"CPU": 1.0}] * num_cpus)
    ray.get(blocker.ready(), timeout=60)
    return blocker


def grow(trainer, batches, record, optimizer_bytes, replicas):
    """Steps until two in a row ran on ``replicas`` replicas (the new one joins at a step boundary once its
    workers are ready); the last step's result."""
    deadline = time.monotonic() + 120
    for x, y in batches:
        result = run_steps(trainer, [(x, y)], record, optimizer_bytes)
        if [r for _, r in record[-2:]] == [replicas, replicas]:
            return result
        assert time.monotonic() < deadline, f"replica {replicas} never joined"
        time.sleep(0.3)  # let the new replica's workers start
    raise AssertionError(f"replica {replicas} had not joined after {len(record)} steps")


@pytest.fixture(scope="module")
def from_two_to_three(ray_cluster):
    """An elastic run of (1, 4) replicas of two stages (2 micro-batches each, 8 a step) under ZeRO-1 and zbv
    (two model chunks a worker) recomputing every forward, started where 2 replicas fit (a placement group
    holds the room of a third: 6 logical CPUs hold 3 replicas of 2 stages), stepped until the room is freed
    and a third replica joined: what each step and the trainer showed, the ops its last step's timeline
    measured and its evaluation of another batch. (A replicated run that grows: tests/test_fit.py's. Its
    first steps are the default executor's zbv on Ray for tests/executor/test_equivalence.py, which runs
    the other chunked cells, and this one, through the step runner in one process.)"""
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 4), clip_grad_norm=0.5,
                                    shard_optimizer=True, schedule="zbv", virtual_stages=2,
                                    activation_checkpoint="always")
    blocker = blocking(2)
    run = {"record": [], "optimizer_bytes": []}
    batches = random_batches(16, 40)
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config) as trainer:
        run["started"] = trainer.num_replicas, [(w.replica, w.stage) for w in trainer.workers]
        run["chunks"] = len(trainer.balance)
        run_steps(trainer, batches[:2], run["record"], run["optimizer_bytes"])  # blocks of 4 and 4
        remove_placement_group(blocker)
        last = grow(trainer, batches[2:], run["record"], run["optimizer_bytes"], 3)  # blocks of 3, 3 and 2
        run["measured_ops"] = {event.op for event in last.timeline}
        run["grown"] = trainer.num_replicas, [(w.replica, w.stage) for w in trainer.workers]
        run["resizes"] = [direction for _, direction, _ in trainer.resizes]
        run["state"] = trainer.state_dict()
        run["evaluated"] = OTHER_BATCH, trainer.evaluate(*OTHER_BATCH)
    run["placement_groups"] = [group["state"] for group in ray.util.placement_group_table().values()]
    return run


def test_an_elastic_run_starts_with_as_many_replicas_as_fit_and_splits_the_step_unevenly(from_two_to_three):
    # the 4th replica stays asked for
    run = from_two_to_three
    assert run["started"] == (2, [(r, s) for r in range(2) for s in range(2)])
    assert run["grown"] == (3, [(r, s) for r in range(3) for s in range(2)])
    record = run["record"]
    replicas = [replicas for _, replicas in record]
    assert replicas[:2] == [2, 2] and replicas[-2:] == [3, 3] and set(replicas) == {2, 3}
    assert_mlp_run_matches_one_process([loss for loss, _ in record], run["state"], 16, 8, clip_grad_norm=0.5)
    assert all(state == "REMOVED" for state in run["placement_groups"])
    # each worker's two chunks; the receives measured with the split backward's I and W
    assert run["chunks"] == 4 and run["measured_ops"] >= {"F", "recv", "I", "W"}
    # the driver's forward through every chunk in order: the final weights' loss on another batch
    model = make_mlp()
    model.load_state_dict(run["state"])
    (x, y), evaluated = run["evaluated"]
    with torch.no_grad():
        assert evaluated == pytest.approx(float(nn.functional.mse_loss(model(x), y)), rel=1e-5)


def test_a_replica_joins_when_its_resources_appear_and_takes_the_runs_state(from_two_to_three):
    # with ZeRO-1 every worker adopts its new owners' parts (of both its model chunks, under zbv); the numbers:
    # the test above. (Replicated, the new replica copies a live one: tests/test_fit.py's elastic run.)
    run = from_two_to_three
    assert run["resizes"] == ["grow"]
    before, grown = run["optimizer_bytes"][0], run["optimizer_bytes"][-1]
    for stage in range(2):  # each parameter's moments on one replica, every replica holding a part
        whole = sum(before[replica, stage] for replica in range(2))
        for layout, replicas in ((before, 2), (grown, 3)):
            parts = [layout[replica, stage] for replica in range(replicas)]
            assert sum(parts) == whole and all(0 < part < whole for part in parts)


def test_an_elastic_minimum_that_cannot_be_placed_is_a_clear_error(ray_cluster):
    config = raypipe.PipelineConfig(num_stages=2, num_replicas=(4, 5), placement_timeout_s=1)
    with pytest.raises(raypipe.PlacementError, match=r"could not place 4 replica\(s\) \(the elastic run's minimum\)"):
        raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config)
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())
