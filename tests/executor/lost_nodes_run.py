"""Four runs that lose nodes, one after another in one multi-node Ray cluster with
shortened health checks (run by tests/executor/test_lost_nodes.py in a subprocess):
``python -m tests.executor.lost_nodes_run OUT.json``. (The fifth, node_loss_run.py,
runs on a cluster of its own with Ray's default health checks.)

One ``ray.cluster_utils.Cluster`` (a head with no CPUs and four 1-CPU worker
nodes) serves all four, so the suite starts one cluster instead of four:

1. elastic_run.py: two replicas of two stages fill the four nodes; one node is
   lost with no room for a replacement (the run shrinks), then a node is added
   (it grows back). Four nodes are alive afterwards. With ZeRO-1 only: its
   shrink and grow are a replicated run's (the same decisions, the same replica
   dropped and started) plus the optimizer's shards moved, which the replicated
   run does not need (one run instead of two: ~45 s of the suite).
2. repartition_run.py: two of the four nodes are removed first, so an elastic
   run's one replica of two stages fills the last two; stage 1's node
   is then lost with no spare, and the model is re-partitioned onto the one
   stage that can be placed; one node is added and the run goes back to its
   two stages in place of the one, then two more and it grows to a second
   replica.
3. tp_node_loss_run.py: three 2-CPU nodes are added (room for a stage of two
   tensor-parallel workers each); (1, 2, 2) fills two, loses stage 1's node with
   both its ranks, and heals on the third.
4. tp_elastic_run.py: two more 2-CPU nodes make four; an elastic (2, 2, 2) fills
   them, loses one with no spare (it shrinks to (1, 2, 2)), and grows back when a
   node is added.

Each part's record goes under its name, with the nodes alive when it ended.
"""
from __future__ import annotations

import sys

import ray
import torch
from ray.cluster_utils import Cluster

from tests.executor import elastic_run, repartition_run, tp_elastic_run, tp_node_loss_run
from tests.executor.cluster_run import remove_node, run_on_cluster


def alive_nodes() -> list[str]:
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])


def lose_every_node(cluster: Cluster) -> dict:
    record = {"elastic_zero1": elastic_run.train(cluster, shard_optimizer=True)}
    workers = [node for node in alive_nodes() if node != cluster.head_node.node_id]
    for node in workers[:2]:  # of the four worker nodes: two stages on two, no spare
        remove_node(cluster, node)
    record["repartition"] = repartition_run.train(cluster)
    record["tp_node_loss"] = tp_node_loss_run.train(cluster)
    record["tp_elastic"] = tp_elastic_run.train(cluster)
    return record


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 4, lose_every_node)
