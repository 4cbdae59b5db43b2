"""A node lost with a whole tensor-parallel stage, in a multi-node Ray cluster (the third
part of lost_nodes_run.py; alone: ``python -m tests.executor.tp_node_loss_run OUT.json``).

Three 2-CPU worker nodes are added to the cluster (its 1-CPU nodes cannot hold a stage of
two workers: a stage's bundle is its t workers' CPUs on one node). (1, 2, 2): each stage's
two tensor-parallel ranks sit on one node, the third node is spare. Before step
:data:`LOST_AT` the node of stage 1 is removed (``allow_graceful=False``, its raylet and
both workers killed at once; the step starts once the GCS has declared it dead, as the other
runs on this cluster do): the step heals with a replacement stage of two workers on
the spare node, both restoring their lost ranks' snapshots (the keeper's copies: the node
is gone), and runs again. The test compares each step and the final state with the same
layout's run without the loss (:class:`tests.gloo_pipeline.GlooPipeline`) bit for bit.
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

STEPS, LOST_AT = 4, 2


def config() -> raypipe.PipelineConfig:
    """(1, 2, 2), 1f1b, sequence parallel, clipping; room for the replacement looked for up to 60 s."""
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, schedule="1f1b", tensor_parallel=2,
                                  clip_grad_norm=0.5, hang_timeout_s=5, replace_timeout_s=60)


def add_tensor_parallel_nodes(cluster: Cluster, count: int) -> None:
    """``count`` nodes of room for one stage of two workers each, up before returning."""
    for _ in range(count):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()


def train(cluster: Cluster) -> dict:
    add_tensor_parallel_nodes(cluster, 3)
    record: dict = {"steps": [], "recovered": []}
    with raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, adamw, config()) as trainer:
        record["nodes_before"] = [worker.node_id for worker in trainer.workers]
        for step, (x, y) in enumerate(batches(STEPS)):
            if step == LOST_AT:
                record["lost_pids"] = [worker.pid for worker in trainer.workers if worker.stage == 1]
                remove_node(cluster, record["nodes_before"][2])  # stage 1's, both its ranks; declared dead
                lost_at = time.monotonic()
            result = trainer.step(x, y)
            record["steps"].append([result.loss, result.grad_norm])
            record["recovered"].append(result.recovered)
            if step == LOST_AT:
                record["seconds"] = time.monotonic() - lost_at
        record["nodes_after"] = [worker.node_id for worker in trainer.workers]
        record["pids_after"] = [worker.pid for worker in trainer.workers]
        record["failures"] = trainer.failures
        record["sources"] = [recovered.source for recovered in trainer.recoveries]
        record["state"] = as_lists(trainer.state_dict())
    record["alive_tensor_parallel_nodes"] = sorted(node["NodeID"] for node in ray.nodes()
                                                   if node["Alive"] and node["Resources"].get("CPU", 0) == 2)
    return record


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 0, train)
