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

import ray
import torch
from ray.cluster_utils import Cluster

import raypipe
from raypipe.models.llama import llama_layers, llama_loss
from tests.executor.cluster_run import run_on_cluster, through_a_node_lost_and_added
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
    steps = []
    with raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, adamw, config()) as trainer:
        record = through_a_node_lost_and_added(
            trainer, cluster, batches(MAX_STEPS),
            lambda: next(w.node_id for w in trainer.workers if (w.replica, w.stage) == (1, 1)),  # both its ranks
            node_cpus=2, lost_at=LOST_AT, added_at=ADDED_AT, grow_deadline_s=GROW_DEADLINE_S,
            # each step taken while the new replica's workers start costs the busy cores a step of the run's four
            # processes and, in the test, a step of the one-process reference
            pause_s=2, on_result=lambda result: steps.append([result.loss, result.grad_norm]))
    return {**record, "steps": steps}


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 0, train)
