"""docs/deploy.md's fake multi-node recipe, run for real: a `fake_multinode`
head, `ray job submit` of `jobs/train_7b.py --preset tiny --stages 4 --steps 3`
without `--working-dir`, the autoscaler adding worker nodes, the job succeeding
with its stages on them.

The head runs in a session of its own; the fake nodes are raylets its
autoscaler starts, in that session too, so stopping the session's processes by
pid stops exactly what the test started. What differs from the recipe: every
port is chosen here (so the GCS address goes into a copy of
clusters/local-fake-multinode.yaml, where the fake provider looks for it),
a fresh token of Ray's token authentication and a fresh `RAYPIPE_CACHE` come
through the environment, the autoscaler's monitor loops every second instead of
every 5 s (``AUTOSCALER_UPDATE_INTERVAL_S=1``, as Ray's own fake-cluster tests
run it), and outputs go to a temporary directory.
"""
from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.deployment.ray_head import (FAKE_AUTOSCALER_ENV, head_ports, job_failure, ray_cli, session_members,
                                       start_head, stop_session, token_env, wait_for_dashboard, wait_for_job)

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 420
FAKE_WORKER_NODE_ID = re.compile(r"f{51}(?!00000)\d{5}")  # the fake provider numbers the nodes it adds from 1


@pytest.mark.cluster
def test_fake_multinode_recipe_trains_on_nodes_the_autoscaler_adds():
    temp_dir = tempfile.mkdtemp(prefix="rpf-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ports = head_ports()
    config = yaml.safe_load((REPO / "clusters" / "local-fake-multinode.yaml").read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{ports['port']}"  # the provider assumes 6379 otherwise
    config_path = Path(temp_dir) / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = token_env(**FAKE_AUTOSCALER_ENV, RAYPIPE_CACHE=str(Path(temp_dir) / "cache"))
    head = start_head(temp_dir, env, ports, "--num-cpus=0", f"--autoscaling-config={config_path}")
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    out = Path(temp_dir) / "out"
    try:
        wait_for_dashboard(head, url, Path(temp_dir) / "ray-start.log")
        job_id = f"raypipe-fake-{secrets.token_hex(4)}"
        submit = [ray_cli(), "job", "submit", "--address", url, "--submission-id", job_id, "--no-wait", "--",
                  sys.executable, str(REPO / "jobs" / "train_7b.py"), "--preset", "tiny", "--stages", "4",
                  "--steps", "3", "--out", str(out)]
        done = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
        status, logs = wait_for_job(url, job_id, env, JOB_TIMEOUT_S)
        assert status == "SUCCEEDED", job_failure(job_id, status, logs)
    finally:
        stop_session(head)
        assert session_members(head.pid) == []
    try:
        assert [int(step) for step in re.findall(r"^step (\d+)/3 loss ", logs, flags=re.MULTILINE)] == [1, 2, 3]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["pipeline"]["num_stages"] == 4 and summary["steps"] == 3
        # the default dataset was prepared in the cache, outside any working directory
        assert summary["data"].startswith(str(Path(temp_dir) / "cache" / "data")), summary["data"]
        nodes = {worker["node_id"] for worker in summary["workers"]}
        assert len(summary["workers"]) == 4 and summary["driver_node_id"] not in nodes
        # 4 one-CPU stages on 2-CPU nodes: at least two nodes, each one the autoscaler added
        assert len(nodes) >= 2 and all(FAKE_WORKER_NODE_ID.fullmatch(node) for node in nodes), nodes
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
