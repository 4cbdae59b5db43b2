"""An elastic run on Ray's fake multi-node autoscaler, for real: the cluster
starts able to hold one replica, the run's autoscaler request makes it add
nodes, the run grows to two replicas with the same numbers as one process, and
the request is withdrawn at shutdown.

The head (``--num-cpus=0``) runs in a session of its own and its autoscaler
starts the fake nodes (1 CPU each, 2 from the start, at most 4) in that session,
so stopping the session's processes by pid stops exactly what the test started.
The driver (elastic_autoscaling_driver.py) is a subprocess with RAY_ADDRESS and
the head's token and no working_dir: the fake nodes share this filesystem, and
PYTHONPATH (in the head's environment, which its nodes' workers inherit, and
the driver's) makes them import this checkout's raypipe and tests. The
autoscaler's view of the standing request is read from ``ray status``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.deployment.ray_head import FAKE_AUTOSCALER_ENV, fake_autoscaling_head, head_ports, token_env
from tests.reference import assert_mlp_run_matches_one_process
from tests.runtime.test_autoscaling import FakeCluster

REPO = Path(__file__).resolve().parents[2]
DRIVER_TIMEOUT_S = 360  # 120 s for the initial nodes, 180 s to grow, the rest to start and stop


def fake_cluster_config(gcs_port: int) -> dict:
    """clusters/local-fake-multinode.yaml with 1-CPU worker nodes, 2 from the start and at most 4."""
    config = yaml.safe_load((REPO / "clusters" / "local-fake-multinode.yaml").read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{gcs_port}"  # the provider assumes 6379 otherwise
    config["max_workers"] = 4
    worker = config["available_node_types"]["ray.worker.cpu"]
    worker.update(min_workers=2, max_workers=4, resources={"CPU": 1, "object_store_memory": 200_000_000})
    return config


def answer(driver: subprocess.Popen, stderr: Path) -> str:
    """The driver's next "> " line (it waits for a command after each)."""
    line = driver.stdout.readline()
    if not line.startswith("> "):
        driver.kill()
        driver.wait()
        pytest.fail(f"the driver said {line!r}, exit status {driver.returncode}:\n{stderr.read_text()[-6000:]}")
    return line[2:].strip()


def tell(driver: subprocess.Popen, command: str) -> None:
    driver.stdin.write(command + "\n")
    driver.stdin.flush()


@pytest.fixture
def fake_cluster():
    temp_dir = tempfile.mkdtemp(prefix="rpe-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ports = head_ports()
    env = token_env(**FAKE_AUTOSCALER_ENV, PYTHONPATH=str(REPO))
    with fake_autoscaling_head(temp_dir, ports, fake_cluster_config(ports["port"]), env) as address:
        yield FakeCluster(address, env), Path(temp_dir)


@pytest.mark.cluster
def test_an_elastic_run_makes_the_autoscaler_add_nodes_grows_and_withdraws_its_request(fake_cluster):
    cluster, temp_dir = fake_cluster
    out, stderr = temp_dir / "run.json", temp_dir / "driver.err"
    started = time.monotonic()
    with open(stderr, "w") as stderr_file:
        driver = subprocess.Popen([sys.executable, "-m", "tests.deployment.elastic_autoscaling_driver", str(out)],
                                  cwd=REPO, env=dict(cluster.env, RAY_ADDRESS=cluster.address),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr_file, text=True)
    try:
        assert answer(driver, stderr) == "grown"
        grown_after_s = time.monotonic() - started
        # the most replicas' bundles (2 stages of 1 CPU, twice) stand while the run lasts
        cluster.wait_until_requested([({"CPU": 1}, 4)])
        tell(driver, "shutdown")
        assert answer(driver, stderr) == "shut down"
        cluster.wait_until_requested([])  # withdrawn by the trainer's shutdown, the driver still connected
        tell(driver, "exit")
        assert driver.wait(timeout=DRIVER_TIMEOUT_S) == 0, stderr.read_text()[-6000:]
    finally:
        driver.kill()
        driver.wait()
    cluster.wait_until_requested([])  # and nothing stands after the driver is gone
    run = json.loads(out.read_text())

    assert len(run["nodes_at_start"]) == 2
    assert run["replicas_at_start"] == 1 and run["num_replicas"][0] == 1
    replicas = run["num_replicas"]
    first_on_two = replicas.index(2)
    assert replicas == [1] * first_on_two + [2, 2, 2]
    assert run["resizes"] == [[first_on_two, "grow", 2]]  # admitted at the boundary before that step
    # the autoscaler added nodes, and the new replica runs on them
    assert set(run["nodes_at_start"]) < set(run["nodes_when_grown"]) and len(run["nodes_when_grown"]) >= 4
    assert [(replica, stage) for replica, stage, _ in run["workers"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert not {node for replica, _, node in run["workers"] if replica == 1} & set(run["nodes_at_start"])

    assert_mlp_run_matches_one_process(run["losses"], run["state"], 8, 4)
    print(f"first step on 2 replicas {run['grow_seconds']:.1f} s after the trainer started ({first_on_two} steps "
          f"on 1); the driver said grown {grown_after_s:.1f} s after it started")
