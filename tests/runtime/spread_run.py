"""Where replicas land on a multi-node cluster (run by tests/runtime/test_spread.py
in a subprocess): ``python -m tests.runtime.spread_run OUT.json``.

``ray.cluster_utils.Cluster``: a head with no CPUs (the driver's node), a big
node of 16 CPUs and a small one of 4. Left to itself Ray's PACK puts both
replicas of two 1-CPU stages on the big node (the one with the most room left).
Three runs of ``num_replicas=2`` (or (1, 2)) on it:

- *spread*: both nodes free;
- *one node full*: the small node's CPUs held by a placement group, so only the
  big node has room (for both replicas);
- *grow*: the big node held but for one replica and the small node held, so an
  elastic run starts with one replica and one asked for; then the big node's
  hold goes (the replica asked for is placed there, beside the running one), then
  the small node's, and the run grows at a step boundary.

Each records where the workers ran, how long the start took and the steps'
losses and final weights; the placement groups left at the end.
"""
from __future__ import annotations

import sys
import time
from dataclasses import astuple

import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from torch import nn

import raypipe
from raypipe.runtime import cluster as runtime_cluster
from tests.executor.cluster_run import as_lists, run_on_cluster
from tests.reference import adamw, make_mlp, random_batches

BIG, SMALL = 16, 4
BATCH, STEPS, MAX_STEPS, GROW_DEADLINE_S = 8, 2, 400, 60  # 4 micro-batches a step: 2 per replica


def hold(node_id: str, cpus: int):
    """A placed placement group holding ``cpus`` CPUs of node ``node_id``."""
    group = placement_group([{"CPU": cpus}], bundle_label_selector=[{"ray.io/node-id": f"in({node_id})"}])
    ray.get(group.ready(), timeout=30)
    return group


def config(num_replicas) -> raypipe.PipelineConfig:
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=num_replicas, cpus_per_stage=1,
                                  placement_timeout_s=60)


def train(num_replicas, keep_going=lambda trainer, step: step < STEPS) -> dict:
    """A run, stepping while ``keep_going(trainer, step)``: where its workers are after
    the start and at the end, the start's seconds, the losses and final weights."""
    record: dict = {"losses": [], "num_replicas": []}
    started = time.monotonic()
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config(num_replicas)) as trainer:
        record["start_seconds"] = time.monotonic() - started
        record["workers_at_start"] = [astuple(worker) for worker in trainer.workers]
        for step, (x, y) in enumerate(random_batches(BATCH, MAX_STEPS)):
            if not keep_going(trainer, step):
                break
            result = trainer.step(x, y)
            record["losses"].append(result.loss)
            record["num_replicas"].append(result.num_replicas)
        record["workers_at_end"] = [astuple(worker) for worker in trainer.workers]
        record["state"] = as_lists(trainer.state_dict())
    return record


def wait_until_placed(deadline_s: float = 30) -> None:
    """Until no placement group is pending."""
    deadline = time.monotonic() + deadline_s
    while any(group["state"] == "PENDING" for group in placement_group_table().values()):
        assert time.monotonic() < deadline, "a placement group was never placed"
        time.sleep(0.1)


def grow(big: str, small: str) -> dict:
    """The elastic run: one replica on the big node at the start; before step 1 the
    holds go, first the big node's, then (once the replica asked for is placed
    beside the running one) the small node's; steps until one ran on two replicas."""
    holds = [hold(big, BIG - 2), hold(small, SMALL)]
    record: dict = {}

    def keep_going(trainer, step: int) -> bool:
        if step == 1:
            remove_placement_group(holds[0])
            wait_until_placed()
            record["nodes_of_the_runs_groups_before_the_small_node_frees"] = sorted(
                {node for group_id, group in placement_group_table().items()
                 if group["state"] == "CREATED" and group_id != holds[1].id.hex()
                 for node in group["bundles_to_node_id"].values()})
            remove_placement_group(holds[1])
            record["deadline"] = time.monotonic() + GROW_DEADLINE_S
        if step >= 1:
            assert time.monotonic() < record["deadline"], "the run never grew"
            time.sleep(0.2)  # steps of this model take milliseconds: give the new replica time to start
        if trainer.num_replicas == 2:
            record.setdefault("grown_at", step)  # this step runs on two replicas: the last one
        return step <= record.get("grown_at", step)

    record.update(train((1, 2), keep_going))
    return record


def runs(cluster: Cluster) -> dict:
    by_cpus = {node["Resources"].get("CPU", 0): node["NodeID"] for node in ray.nodes()}
    big, small = by_cpus[BIG], by_cpus[SMALL]
    record = {"big": big, "small": small, "spread": train(2)}
    small_held = hold(small, SMALL)
    started = time.monotonic()
    placed, _ = runtime_cluster.reserve_between(2, 2, [{"CPU": 1.0}] * 2, timeout_s=60)
    record["reserve_seconds_one_node_full"] = time.monotonic() - started
    runtime_cluster.release(placed)
    record["one_node_full"] = train(2)
    remove_placement_group(small_held)
    record["grow"] = grow(big, small)
    record["groups_left"] = [group["state"] for group in placement_group_table().values()]
    return record


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 2, runs, node_cpus=[BIG, SMALL])
