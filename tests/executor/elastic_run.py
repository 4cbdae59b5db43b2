"""An elastic run that loses a node and gets one back, in its own multi-node
Ray cluster (run by tests/executor/test_elastic.py in a subprocess):
``python -m tests.executor.elastic_run OUT.json``.

``ray.cluster_utils.Cluster``: a head with no CPUs (the driver's node) and four
1-CPU worker nodes, so ``num_replicas=(1, 2)`` of two stages fills every node.
Before step 2 the node of replica 1's stage 1 is removed (``allow_graceful=False``):
its replacement finds no room within ``replace_timeout_s``, so that replica is
dropped and the run goes on with one. Then a node is added: the replica asked
for is placed, starts while steps run, and joins at a step boundary. Prints
what the test checks as JSON.
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

LOST_AT, ADDED_AT, MAX_STEPS, GROW_DEADLINE_S = 2, 4, 40, 120
BATCH = 12  # 4 micro-batches a step: 2 per replica with 2 replicas, 4 with one


def wait_until_dead(node_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes()):
        assert time.monotonic() < deadline, f"node {node_id} is still alive"
        time.sleep(0.2)


def main(out: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(4):
        cluster.add_node(num_cpus=1)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 2), clip_grad_norm=0.5,
                                    hang_timeout_s=5, replace_timeout_s=5, placement_timeout_s=60)
    batches = random_batches(BATCH, MAX_STEPS)
    record: dict = {"losses": [], "num_replicas": [], "recovered": []}
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
        with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config) as trainer:
            record["replicas_at_start"] = trainer.num_replicas
            record["nodes_at_start"] = [worker.node_id for worker in trainer.workers]
            for step, (x, y) in enumerate(batches):
                if step == LOST_AT:
                    lost = next(node for node in cluster.worker_nodes if node.node_id == trainer.workers[3].node_id)
                    lost_at = time.monotonic()
                    cluster.remove_node(lost, allow_graceful=False)
                    wait_until_dead(lost.node_id)  # so that this step, not a later one, finds the loss
                if step == ADDED_AT:
                    cluster.add_node(num_cpus=1)
                    added_at = time.monotonic()
                result = trainer.step(x, y)
                record["losses"].append(result.loss)
                record["num_replicas"].append(result.num_replicas)
                record["recovered"].append(result.recovered)
                if step == LOST_AT:
                    record["shrink_seconds"] = time.monotonic() - lost_at
                if step >= ADDED_AT and result.num_replicas == 2:
                    record.setdefault("grow_seconds", time.monotonic() - added_at)
                    if record["num_replicas"][-3:] == [2, 2, 2]:
                        break
                if step >= ADDED_AT:
                    assert time.monotonic() - added_at < GROW_DEADLINE_S, "the run never grew back"
                    time.sleep(0.5)  # steps of this model take milliseconds: give the new replica time to start
            record["resizes"] = trainer.resizes
            record["failures"] = trainer.failures
            record["nodes_at_end"] = [worker.node_id for worker in trainer.workers]
            record["state"] = {key: value.tolist() for key, value in trainer.state_dict().items()}
        record["alive_nodes"] = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
        with open(out, "w") as file:
            json.dump(record, file)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1])
