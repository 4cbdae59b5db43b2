"""An elastic run that loses a node and gets one back, in a multi-node Ray
cluster (the first part of lost_nodes_run.py; alone:
``python -m tests.executor.elastic_run OUT.json``).

``ray.cluster_utils.Cluster``: a head with no CPUs (the driver's node) and four
1-CPU worker nodes, so ``num_replicas=(1, 2)`` of two stages fills every node.
Before step 2 the node of replica 1's stage 1 is removed (``allow_graceful=False``):
its replacement finds no room within ``replace_timeout_s``, so that replica is
dropped and the run goes on with one. Then a node is added: the replica asked
for is placed, starts while steps run, and joins at a step boundary. Prints
what the test checks as JSON. With ``shard_optimizer`` (ZeRO-1) the lost
worker's optimizer part exists only in its snapshot (the keeper's copy, off
the lost node), and every resize moves parameters to other owners.
"""
from __future__ import annotations

import sys

import torch
from ray.cluster_utils import Cluster
from torch import nn

import raypipe
from tests.executor.cluster_run import run_on_cluster, through_a_node_lost_and_added
from tests.reference import adamw, make_mlp, random_batches

LOST_AT, ADDED_AT, MAX_STEPS, GROW_DEADLINE_S = 2, 4, 300, 120  # the deadline ends a slow grow, not MAX_STEPS
BATCH = 12  # 4 micro-batches a step: 2 per replica with 2 replicas, 4 with one


def train(cluster: Cluster, shard_optimizer: bool = False) -> dict:
    # replace_timeout_s: the lost node's replacement waits that long for room that no node has before the
    # replica is dropped (an idle wait: the shrink is the same after 1 s as after 60)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 2), clip_grad_norm=0.5,
                                    hang_timeout_s=5, replace_timeout_s=1, placement_timeout_s=60,
                                    shard_optimizer=shard_optimizer)
    losses, optimizer_bytes = [], []

    def keep(result) -> None:
        losses.append(result.loss)
        optimizer_bytes.append([[stage.replica, stage.stage, stage.optimizer_bytes] for stage in result.stages])

    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config) as trainer:
        record = through_a_node_lost_and_added(
            trainer, cluster, random_batches(BATCH, MAX_STEPS), lambda: trainer.workers[3].node_id,  # replica 1's stage 1
            node_cpus=1, lost_at=LOST_AT, added_at=ADDED_AT, grow_deadline_s=GROW_DEADLINE_S,
            pause_s=0.5,  # steps of this model take milliseconds: give the new replica time to start
            on_result=keep)
    return {**record, "losses": losses, "optimizer_bytes": optimizer_bytes}


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 4, train)
