"""Three runs that lose nodes, one after another in one multi-node Ray cluster
(run by tests/executor/test_lost_nodes.py in a subprocess): ``python -m
tests.executor.lost_nodes_run OUT.json``.

One ``ray.cluster_utils.Cluster`` (a head with no CPUs and four 1-CPU worker
nodes) serves all three, so the suite starts one cluster instead of three:

1. elastic_run.py: two replicas of two stages fill the four nodes; one node is
   lost with no room for a replacement (the run shrinks), then a node is added
   (it grows back). Four nodes are alive afterwards. Then the same with ZeRO-1.
2. node_loss_run.py: two stages and spare nodes; stage 1's node is lost while
   the keeper of snapshots lags, and the stage moves to a spare node (under
   NCCL's emulation: the suite's node loss under it).
3. repartition_run.py: one node of the three left is removed first, so an
   elastic run's one replica of two stages fills the last two; stage 1's node
   is then lost with no spare, and the model is re-partitioned onto the one
   stage that can be placed; one node is added and the run goes back to its
   two stages in place of the one, then two more and it grows to a second
   replica.

Each part's record goes under its name, with the nodes alive when it ended.
"""
from __future__ import annotations

import sys

import ray
import torch
from ray.cluster_utils import Cluster

from tests.executor import elastic_run, node_loss_run, repartition_run
from tests.executor.cluster_run import remove_node, run_on_cluster


def alive_nodes() -> list[str]:
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])


def lose_every_node(cluster: Cluster) -> dict:
    record = {"elastic": elastic_run.train(cluster)}
    record["elastic"]["alive_nodes"] = alive_nodes()
    record["elastic_zero1"] = elastic_run.train(cluster, shard_optimizer=True)
    record["node_loss"] = {"uninterrupted": node_loss_run.train(None),  # on gloo; the loss under NCCL's emulation
                           "lost": node_loss_run.train(cluster, emulate_nccl=True)}
    record["node_loss"]["alive_nodes"] = alive_nodes()
    workers = [node for node in record["node_loss"]["alive_nodes"] if node != cluster.head_node.node_id]
    remove_node(cluster, workers[0])  # of the three worker nodes left: two stages on two, no spare
    record["repartition"] = repartition_run.train(cluster)
    return record


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 4, lose_every_node)
