"""A one-replica run that loses a node with no spare, in a multi-node Ray
cluster (the last part of lost_nodes_run.py; alone:
``python -m tests.executor.repartition_run OUT.json``).

``ray.cluster_utils.Cluster``: a head with no CPUs (the driver's node) and two
1-CPU worker nodes, one stage on each. Before step 2 the node of stage 1 is
removed (``allow_graceful=False``): no node has room for its replacement, so
the model is re-partitioned onto the one stage that can be placed, which takes
both stages' layers from the newest snapshot. Prints what the test checks as JSON.
"""
from __future__ import annotations

import sys
import urllib.request

import torch
from ray.cluster_utils import Cluster
from torch import nn

import raypipe
from tests.executor.cluster_run import as_lists, remove_node, run_on_cluster
from tests.reference import adamw, make_mlp, random_batches

STEPS, LOST_AT = 5, 2


def train(cluster: Cluster) -> dict:
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, clip_grad_norm=0.5, hang_timeout_s=5,
                                    replace_timeout_s=5, placement_timeout_s=30, metrics_port=0)
    record: dict = {"losses": [], "recovered": []}
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config) as trainer:
        record["balance_at_start"] = list(trainer.balance)
        for step, (x, y) in enumerate(random_batches(8, STEPS)):
            if step == LOST_AT:
                remove_node(cluster, trainer.workers[1].node_id)  # stage 1's, with no spare
            result = trainer.step(x, y)
            record["losses"].append(result.loss)
            record["recovered"].append(result.recovered)
        record["balance_at_end"] = list(trainer.balance)
        record["workers_at_end"] = [(worker.replica, worker.stage) for worker in trainer.workers]
        record["sources"] = [recovered.source for recovered in trainer.recoveries]
        record["resizes"] = trainer.resizes
        with urllib.request.urlopen(trainer.metrics_url, timeout=10) as response:
            record["metrics"] = [line for line in response.read().decode().splitlines()
                                 if line.startswith(("raypipe_resizes_total", "raypipe_replicas"))]
        record["state"] = as_lists(trainer.state_dict())
    return record


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 2, train)
