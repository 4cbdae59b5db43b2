"""The driver of tests/deployment/test_elastic_autoscaling.py: an elastic run
(``num_replicas=(1, 2)``, 2 stages of 1 CPU) on a fake multi-node cluster that
starts with two 1-CPU worker nodes, so one replica fits and the autoscaler must
add nodes for the second.

``python -m tests.deployment.elastic_autoscaling_driver OUT.json``, connected
with RAY_ADDRESS and the head's token. Steered through stdin so that the test
can read the autoscaler's view of the standing request at two moments: it says
``> grown`` once the run has made 2 steps more after its first step on 2
replicas and waits for ``shutdown``; it says ``> shut down`` after the trainer's
shutdown and waits for ``exit``; then it writes what the test checks to OUT.json.
"""
from __future__ import annotations

import json
import sys
import time

import ray
from torch import nn

import raypipe
from tests.reference import adamw, make_mlp, random_batches

BATCH = 8  # 4 micro-batches a step (num_micro_batches x max replicas): 4 on one replica, 2 each on two
NODES_AT_START = 2
NODES_WAIT_S = 120
GROW_DEADLINE_S = 180
MAX_STEPS = 500  # more than GROW_DEADLINE_S allows at one step per STEP_PAUSE_S
STEP_PAUSE_S = 0.5  # steps of this model take milliseconds: the autoscaler's nodes take seconds


def alive_worker_nodes() -> list[str]:
    """The alive nodes with CPUs (the head has none), by id."""
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0)


def wait_for_worker_nodes(count: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while len(nodes := alive_worker_nodes()) < count:
        assert time.monotonic() < deadline, f"only {len(nodes)} of the {count} initial worker nodes came up"
        time.sleep(0.25)
    return nodes


def say(message: str) -> None:
    print(">", message, flush=True)


def wait_for(command: str) -> None:
    line = sys.stdin.readline().strip()
    assert line == command, f"expected {command!r} on stdin, got {line!r}"


def train_until_grown(trainer: raypipe.PipelineTrainer, record: dict) -> None:
    """Step until the run has made 3 steps on 2 replicas (the first one and 2 more)."""
    started = time.monotonic()
    for x, y in random_batches(BATCH, MAX_STEPS):
        result = trainer.step(x, y)
        record["losses"].append(result.loss)
        record["num_replicas"].append(result.num_replicas)
        if result.num_replicas == 2:
            record.setdefault("grow_seconds", time.monotonic() - started)
            if record["num_replicas"][-3:] == [2, 2, 2]:
                return
        assert time.monotonic() - started < GROW_DEADLINE_S, \
            f"no second replica within {GROW_DEADLINE_S}s; alive worker nodes: {alive_worker_nodes()}"
        time.sleep(STEP_PAUSE_S)
    raise AssertionError(f"no 3 steps on 2 replicas within {MAX_STEPS} steps")


def main(out: str) -> None:
    ray.init(logging_level="ERROR", log_to_driver=False)  # stdout carries the "> " lines only
    record: dict = {"losses": [], "num_replicas": [],
                    "nodes_at_start": wait_for_worker_nodes(NODES_AT_START, NODES_WAIT_S)}
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 2))
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, config) as trainer:
        record["replicas_at_start"] = trainer.num_replicas
        train_until_grown(trainer, record)
        record["resizes"] = trainer.resizes
        record["workers"] = [(worker.replica, worker.stage, worker.node_id) for worker in trainer.workers]
        record["nodes_when_grown"] = alive_worker_nodes()
        record["state"] = {key: value.tolist() for key, value in trainer.state_dict().items()}
        say("grown")
        wait_for("shutdown")
    say("shut down")
    wait_for("exit")
    with open(out, "w") as file:
        json.dump(record, file)


if __name__ == "__main__":
    main(sys.argv[1])
