"""A run that loses a node, in its own multi-node Ray cluster (run by
tests/executor/test_node_loss.py in a subprocess): ``python -m
tests.executor.node_loss_run OUT.json``.

``ray.cluster_utils.Cluster``: a head with no CPUs (the driver's node) and
three 1-CPU worker nodes, so the two stages sit on two nodes and the third is
spare. The same steps run twice: without failures, then with the node of
stage 1 removed (``allow_graceful=False``, its raylet and workers killed)
before step 2. Prints what the test checks as JSON.
"""
from __future__ import annotations

import json
import os
import sys
import time

# the GCS declares a lost node dead after ~2 s instead of ~15 s (read when the cluster starts)
os.environ.update(RAY_health_check_initial_delay_ms="0", RAY_health_check_period_ms="500",
                  RAY_health_check_timeout_ms="1000", RAY_health_check_failure_threshold="3")

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from torch import nn  # noqa: E402

import raypipe  # noqa: E402
from tests.reference import adamw, make_mlp, random_batches  # noqa: E402

STEPS, LOST_AT = 4, 2


def train(cluster: Cluster | None) -> dict:
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, hang_timeout_s=5, replace_timeout_s=60)
    model = make_mlp(width=256)  # snapshots of ~0.5 MB: in the object store of the node, not inline
    with raypipe.PipelineTrainer(model, nn.functional.mse_loss, adamw, config) as trainer:
        nodes_before = [worker.node_id for worker in trainer.workers]
        losses, seconds = [], None
        for step, (x, y) in enumerate(random_batches(8, STEPS)):
            if cluster is not None and step == LOST_AT:
                lost = next(node for node in cluster.worker_nodes if node.node_id == nodes_before[1])
                cluster.remove_node(lost, allow_graceful=False)
                start = time.monotonic()
            losses.append(trainer.step(x, y).loss)
            if cluster is not None and step == LOST_AT:
                seconds = time.monotonic() - start
        state = trainer.state_dict()
        return {"losses": losses, "state": {k: v.tolist() for k, v in state.items()}, "nodes_before": nodes_before,
                "nodes_after": [worker.node_id for worker in trainer.workers], "failures": trainer.failures,
                "seconds": seconds}


def main(out: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
        uninterrupted = train(None)
        lost = train(cluster)
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        with open(out, "w") as file:
            json.dump({"uninterrupted": uninterrupted, "lost": lost, "alive_nodes": sorted(alive),
                       "head": cluster.head_node.node_id}, file)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1])
