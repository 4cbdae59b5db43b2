"""A run that loses a node, in a multi-node Ray cluster with Ray's default health
checks, as a user's cluster has them (run by tests/executor/test_lost_nodes.py in
a subprocess: ``python -m tests.executor.node_loss_run OUT.json``).

``ray.cluster_utils.Cluster``: a head with no CPUs (the driver's node) and
three 1-CPU worker nodes, so the two stages sit on two nodes and the third is
spare. The steps run with the node of stage 1 removed (``allow_graceful=False``,
its raylet and workers killed) before step 2, under NCCL's emulation
(``RAYPIPE_EMULATE_NCCL=1``: no transfer raises when a peer goes, only the
driver's abort releases the survivor). The keeper of snapshots on the driver's
node copies the first snapshot and is then stopped (SIGSTOP) until the node is gone,
as a keeper lags on a busy machine or with a large state over a slow link: it
never gets the snapshot of step 1 off the node, and the heal falls back to its
copy of step 0's. The GCS declares the node dead only ~15-30 s later, so the
replacement is first started into the lost node's bundle, not yet re-placed, and
dies as it starts: it is started again until Ray re-places the bundle on the
spare node. Writes what the test checks as JSON, with the heal's warnings. (The
same steps without failures, which the test compares them with bitwise, are the
step runner's in the test's process: :func:`uninterrupted`, no cluster needed.)
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time

import psutil
import torch
from ray._private import ray_constants
from ray.cluster_utils import Cluster
from torch import nn

import raypipe
from tests.executor.cluster_run import as_lists, remove_node, run_on_cluster
from tests.reference import adamw, in_process, make_mlp, random_batches

STEPS, LOST_AT = 4, 2


def config() -> raypipe.PipelineConfig:
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, hang_timeout_s=5, replace_timeout_s=60)


def model() -> nn.Sequential:
    return make_mlp(width=256)  # snapshots of ~0.5 MB: in the object store of the node, not inline


def uninterrupted() -> dict:
    """The run without failures on the step runner in process (tests.reference.InterpretedTrainer),
    whose every bit a Ray run of this layout repeats: the losses and final state the lost run must equal."""
    with in_process(model(), nn.functional.mse_loss, adamw, config()) as trainer:
        losses = [trainer.step(x, y).loss for x, y in random_batches(8, STEPS)]
        return {"losses": losses, "state": as_lists(trainer.state_dict())}


def train(cluster: Cluster, emulate_nccl: bool = False) -> dict:
    """The run that loses a node of ``cluster``; ``emulate_nccl``: its workers'
    transfers under NCCL's emulation (raypipe.comm.nccl_emulation), so that only the
    driver's abort releases stage 0 when stage 1's node goes."""
    before = os.environ.get("RAYPIPE_EMULATE_NCCL")
    if emulate_nccl:
        os.environ["RAYPIPE_EMULATE_NCCL"] = "1"  # read by this driver when the workers join
    warnings = _Warnings()
    logging.getLogger("raypipe").addHandler(warnings)
    try:
        return {**_train(cluster), "warnings": warnings.messages}
    finally:
        logging.getLogger("raypipe").removeHandler(warnings)
        if before is None:
            os.environ.pop("RAYPIPE_EMULATE_NCCL", None)
        else:
            os.environ["RAYPIPE_EMULATE_NCCL"] = before


def _train(cluster: Cluster) -> dict:
    with raypipe.PipelineTrainer(model(), nn.functional.mse_loss, adamw, config()) as trainer:
        nodes_before = [worker.node_id for worker in trainer.workers]
        losses, seconds = [], None
        keeper = the_keeper(cluster)
        for step, (x, y) in enumerate(random_batches(8, STEPS)):
            if step == 0:
                keeper.send_signal(signal.SIGSTOP)
            if step == LOST_AT:
                remove_node(cluster, nodes_before[1], wait=False)
                keeper.send_signal(signal.SIGCONT)
                start = time.monotonic()
            losses.append(trainer.step(x, y).loss)
            if step == LOST_AT:
                seconds = time.monotonic() - start
        return {"losses": losses, "state": as_lists(trainer.state_dict()), "nodes_before": nodes_before,
                "nodes_after": [worker.node_id for worker in trainer.workers], "failures": trainer.failures,
                "seconds": seconds, "healed_from": [(recovered.source, recovered.replayed_steps)
                                                    for recovered in trainer.recoveries]}


class _Warnings(logging.Handler):
    """raypipe's warnings of the run, as text."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def the_keeper(cluster: Cluster) -> psutil.Process:
    """The process of the trainer's snapshot keeper (Ray titles an actor's process by its class):
    a child of one of this cluster's raylets, so that a trainer of another Ray instance on the machine
    (a benchmark, a second pytest run) is not taken for it."""
    raylets = {node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
               for node in [cluster.head_node, *cluster.worker_nodes]}
    keepers = [process for process in psutil.process_iter(["cmdline", "ppid"])
               if (process.info["cmdline"] or [""])[0].startswith("ray::SnapshotKeeper")
               and process.info["ppid"] in raylets]
    assert len(keepers) == 1, keepers
    return keepers[0]


if __name__ == "__main__":
    torch.manual_seed(0)
    run_on_cluster(sys.argv[1], 3, lambda cluster: {"lost": train(cluster, emulate_nccl=True)},
                   fast_health_checks=False)
