"""What the multi-node runs (lost_nodes_run.py and its parts; spread_run.py)
share: their own ``ray.cluster_utils.Cluster`` with fast node-death detection,
removing a node the way a lost machine goes, and handing results to the test
that started them as JSON; and, on the test's side, starting one in a subprocess.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil
import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster

from raypipe.runtime.cluster import WORKER_KILL_GRACE_MS

REPO = Path(__file__).resolve().parents[2]

# the GCS declares a lost node dead after ~2 s instead of ~15 s (read when the cluster's GCS starts),
# and every raylet SIGKILLs a worker it was told to kill after raypipe's grace, as deployed
FAST_HEALTH_CHECKS = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
                      "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3",
                      "RAY_kill_worker_timeout_milliseconds": str(WORKER_KILL_GRACE_MS)}


def run_on_cluster(out: str, num_nodes: int, body: Callable[[Cluster], dict],
                   node_cpus: list[int] | None = None, fast_health_checks: bool = True) -> None:
    """``body(cluster)`` on a head with no CPUs (the driver's node) and ``num_nodes``
    worker nodes of ``node_cpus`` CPUs each (default 1); writes what it returns to
    ``out`` as JSON. ``fast_health_checks``: :data:`FAST_HEALTH_CHECKS`; else Ray's
    defaults, as a user's cluster has them (a lost node is declared dead after ~15-30 s),
    with only the raylets' kill grace as deployed."""
    node_cpus = node_cpus or [1] * num_nodes
    assert len(node_cpus) == num_nodes, f"{num_nodes} nodes, CPUs given for {len(node_cpus)}"
    if fast_health_checks:
        os.environ.update(FAST_HEALTH_CHECKS)
    else:
        for name in FAST_HEALTH_CHECKS:
            os.environ.pop(name, None)
        os.environ["RAY_kill_worker_timeout_milliseconds"] = str(WORKER_KILL_GRACE_MS)
    # no dashboard (as raypipe starts Ray): nothing here reads it, and its processes take CPU from the run
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for num_cpus in node_cpus:
        cluster.add_node(num_cpus=num_cpus)
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
        record = body(cluster)
        record["alive_nodes"] = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
        record["head"] = cluster.head_node.node_id
        with open(out, "w") as file:
            json.dump(record, file)
    finally:
        ray.shutdown()
        cluster.shutdown()


def remove_node(cluster: Cluster, node_id: str, wait: bool = True) -> None:
    """Remove node ``node_id`` abruptly, the way a lost machine goes: its raylet and
    every worker process killed at once (left alone, workers outlive their raylet by
    up to a second, and a short step may still finish on them). With ``wait``, until
    the GCS declares it dead."""
    node = next(node for node in cluster.worker_nodes if node.node_id == node_id)
    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    workers = raylet.children(recursive=True)
    cluster.remove_node(node, allow_graceful=False)
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()
    deadline = time.monotonic() + 60
    while wait and any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes()):
        assert time.monotonic() < deadline, f"node {node_id} is still alive"
        time.sleep(0.2)


def through_a_node_lost_and_added(trainer: Any, cluster: Cluster, batches: Iterable[tuple], lost_node: Callable[[], str],
                                  node_cpus: int, lost_at: int, added_at: int, grow_deadline_s: float, pause_s: float,
                                  on_result: Callable[[Any], None] = lambda result: None) -> dict:
    """An elastic run of two replicas through a lost node and a new one: ``trainer`` steps over
    ``batches``; before step ``lost_at`` the node ``lost_node()`` names is removed (:func:`remove_node`),
    before step ``added_at`` a node of ``node_cpus`` CPUs is added, and the run ends once three steps
    in a row ran on two replicas after that (failing after ``grow_deadline_s`` without), ``pause_s``
    after each step before the grow giving the new replica's workers time to start. ``on_result(result)`` after
    each step. What the tests read: the start, each step's replicas and heal flag, the seconds the
    shrink and the grow took, and the end (resizes, failures, heal sources, workers, nodes, state)."""
    record: dict = {"replicas_at_start": trainer.num_replicas, "nodes_at_start": [w.node_id for w in trainer.workers],
                    "num_replicas": [], "recovered": []}
    for step, (x, y) in enumerate(batches):
        if step == lost_at:
            lost_since, record["lost_node"] = time.monotonic(), lost_node()
            remove_node(cluster, record["lost_node"])
        if step == added_at:
            cluster.add_node(num_cpus=node_cpus)
            added_since = time.monotonic()
        result = trainer.step(x, y)
        on_result(result)
        record["num_replicas"].append(result.num_replicas)
        record["recovered"].append(result.recovered)
        if step == lost_at:
            record["shrink_seconds"] = time.monotonic() - lost_since
        if step >= added_at:
            if result.num_replicas == 2:
                record.setdefault("grow_seconds", time.monotonic() - added_since)
            if record["num_replicas"][-3:] == [2, 2, 2]:
                break
            assert time.monotonic() - added_since < grow_deadline_s, "the run never grew back"
            if result.num_replicas < 2:  # once grown, the steps that check it need no start time
                time.sleep(pause_s)
    record.update(resizes=trainer.resizes, failures=trainer.failures,
                  sources=[recovered.source for recovered in trainer.recoveries],
                  workers_at_end=[(w.replica, w.stage, w.tp_rank) for w in trainer.workers],
                  nodes_at_end=[w.node_id for w in trainer.workers], state=as_lists(trainer.state_dict()))
    return record


def as_lists(state: dict) -> dict:
    """A state dict as JSON (floats compare exactly after the round trip)."""
    return {key: value.tolist() for key, value in state.items()}


class Subprocess:
    """``python -m module OUT *arguments`` started from the repository root, running beside
    the caller (its output to ``OUT.log``, so that two at once never block on a full pipe)
    until :meth:`result`."""

    def __init__(self, module: str, out: Path, timeout_s: float, arguments: Sequence[str] = ()) -> None:
        self.module, self.out, self.timeout_s = module, out, timeout_s
        self.log = out.with_name(out.name + ".log")
        self._deadline = time.monotonic() + timeout_s
        with open(self.log, "w") as log:
            self._process = subprocess.Popen([sys.executable, "-m", module, str(out), *arguments], cwd=REPO,
                                             stdout=log, stderr=subprocess.STDOUT, text=True)

    def result(self) -> dict:
        """What the run wrote, once it ended. Past ``timeout_s`` from its start it is killed and
        fails with what it printed (keep ``timeout_s`` below pytest's own timeout)."""
        try:
            self._process.wait(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.module} ran past {self.timeout_s:g}s; its output:\n"
                                 f"{self.log.read_text(errors='replace')[-9000:]}") from None
        assert self._process.returncode == 0, f"{self.module} exited with {self._process.returncode}; its output:\n" \
                                              f"{self.log.read_text(errors='replace')[-9000:]}"
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        """Kill the run if it still runs (a test that failed before it needed its result)."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def run_in_subprocess(module: str, out: Path, timeout_s: float, arguments: Sequence[str] = ()) -> dict:
    """Run ``python -m module OUT *arguments`` from the repository root; what it wrote. Past
    ``timeout_s`` it fails with what the run printed (keep it below pytest's own timeout)."""
    return Subprocess(module, out, timeout_s, arguments).result()
