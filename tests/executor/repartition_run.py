"""A one-replica run that loses a node with no spare, in its own multi-node Ray
cluster (run by tests/executor/test_elastic.py in a subprocess):
``python -m tests.executor.repartition_run OUT.json``.

``ray.cluster_utils.Cluster``: a head with no CPUs (the driver's node) and two
1-CPU worker nodes, one stage on each. Before step 2 the node of stage 1 is
removed (``allow_graceful=False``): no node has room for its replacement, so
the model is re-partitioned onto the one stage that can be placed, which takes
both stages' layers from the newest snapshot. Prints what the test checks as JSON.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

# the GCS declares a lost node dead after ~2 s instead of ~15 s (read when the cluster starts)
os.environ.update(RAY_health_check_initial_delay_ms="0", RAY_health_check_period_ms="500",
                  RAY_health_check_timeout_ms="1000", RAY_health_check_failure_threshold="3")

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from torch import nn  # noqa: E402

import raypipe  # noqa: E402
from tests.reference import adamw, make_mlp, random_batches  # noqa: E402

STEPS, LOST_AT = 5, 2


def wait_until_dead(node_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes()):
        assert time.monotonic() < deadline, f"node {node_id} is still alive"
        time.sleep(0.2)


def main(out: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, clip_grad_norm=0.5, hang_timeout_s=5,
                                    replace_timeout_s=5, placement_timeout_s=30, metrics_port=0)
    record: dict = {"losses": [], "recovered": []}
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
        with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config) as trainer:
            record["balance_at_start"] = list(trainer.balance)
            for step, (x, y) in enumerate(random_batches(8, STEPS)):
                if step == LOST_AT:
                    lost = next(node for node in cluster.worker_nodes if node.node_id == trainer.workers[1].node_id)
                    cluster.remove_node(lost, allow_graceful=False)
                    wait_until_dead(lost.node_id)  # so that this step, not a later one, finds the loss
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
            record["state"] = {key: value.tolist() for key, value in trainer.state_dict().items()}
        with open(out, "w") as file:
            json.dump(record, file)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1])
