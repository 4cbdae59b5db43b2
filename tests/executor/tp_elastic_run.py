"""An elastic run at t = 2 that loses a node and gets one back, in a multi-node Ray cluster
(a part of lost_nodes_run.py, after tp_node_loss_run.py; alone:
``python -m tests.executor.tp_elastic_run OUT.json``).

Four 2-CPU nodes, each room for one stage of two tensor-parallel workers:
``num_replicas=(1, 2)`` of two stages at t = 2, (2, 2, 2), fills them. Before step
:data:`LOST_AT` the node of replica 1's stage 1 is removed with both its ranks: its
replacement finds no room within ``replace_timeout_s``, so that replica is dropped and the
run goes on as (1, 2, 2). Then a 2-CPU node is added: the second replica is placed, starts
while steps run, and joins at a step boundary, back to (2, 2, 2). The test compares every
step and the final state with one process within 1e-4 (the reduction order differs).
"""
from __future__ import annotations

import sys
import time

import ray
import torch
from ray.cluster_utils import Cluster

import raypipe
from raypipe.models.llama import llama_layers, llama_loss
from tests.executor.cluster_run import as_lists, remove_node, run_on_cluster
from tests.executor.tp_kills_run import adamw, batches

LOST_AT, ADDED_AT, MAX_STEPS, GROW_DEADLINE_S = 2, 4, 200, 120  # the deadline ends a slow grow, not MAX_STEPS


def config() -> raypipe.PipelineConfig:
    """One or two replicas of (2 stages, t = 2), 1f1b, sequence parallel, clipping; 4 micro-batches a
    step (2 per replica with two replicas, 4 with one). The lost stage's replacement waits
    ``replace_timeout_s`` = 1 s for room that no node has before its replica is dropped."""
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 2), schedule="1f1b",
                                  tensor_parallel=2, clip_grad_norm=0.5, hang_timeout_s=5, replace_timeout_s=1,
                                  placement_timeout_s=60)


def tensor_parallel_nodes() -> list[str]:
    """The live nodes with room for one stage of two workers (2 CPUs)."""
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) == 2)


def train(cluster: Cluster) -> dict:
    for _ in range(4 - len(tensor_parallel_nodes())):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    record: dict = {"steps": [], "num_replicas": [], "recovered": []}
    with raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, adamw, config()) as trainer:
        record["replicas_at_start"] = trainer.num_replicas
        record["nodes_at_start"] = [worker.node_id for worker in trainer.workers]
        for step, (x, y) in enumerate(batches(MAX_STEPS)):
            if step == LOST_AT:
                lost = next(worker for worker in trainer.workers if (worker.replica, worker.stage) == (1, 1))
                record["lost_node"] = lost.node_id
                remove_node(cluster, lost.node_id)  # both of the stage's ranks
            if step == ADDED_AT:
                cluster.add_node(num_cpus=2)
                added_at = time.monotonic()
            result = trainer.step(x, y)
            record["steps"].append([result.loss, result.grad_norm])
            record["num_replicas"].append(result.num_replicas)
            record["recovered"].append(result.recovered)
            if step >= ADDED_AT and record["num_replicas"][-3:] == [2, 2, 2]:
                break
            if step >= ADDED_AT:
                assert time.monotonic() - added_at < GROW_DEADLINE_S, "the run never grew back"
                # give the new replica's workers time to start: each step taken meanwhile costs the busy cores a
                # step of the run's four processes and, in the test, a step of the one-process reference
                time.sleep(2)
        record["resizes"] = trainer.resizes
        record["failures"] = trainer.failures
        record["workers_at_end"] = [(worker.replica, worker.stage, worker.tp_rank) for worker in trainer.workers]
        record["nodes_at_end"] = [worker.node_id for worker in trainer.workers]
        record["state"] = as_lists(trainer.state_dict())
    return record


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 0, train)
