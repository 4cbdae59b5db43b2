"""The local Ray instance raypipe starts itself (``cluster.connect`` with no
cluster to join) kills a hung worker within its 1 s grace, not Ray's 5 s: a
stopped actor process is gone about a second after ``ray.kill``. Its own
instance, in a subprocess."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raypipe.runtime.cluster import WORKER_KILL_GRACE_MS

REPO = Path(__file__).resolve().parents[2]

HUNG_WORKER = """
import os, signal
import ray
from raypipe.runtime import cluster
from tests.processes import seconds_until_gone

cluster.connect(None, 1)

@ray.remote(num_cpus=1)
class Hung:
    def pid(self):
        return os.getpid()

actor = Hung.remote()
pid = ray.get(actor.pid.remote())
os.kill(pid, signal.SIGSTOP)
ray.kill(actor)
print(seconds_until_gone(pid))
ray.shutdown()
"""


@pytest.mark.cluster
def test_the_local_instance_kills_a_hung_worker_within_its_grace():
    no_cluster_to_join = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", HUNG_WORKER], cwd=REPO, env=no_cluster_to_join, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    seconds = float(done.stdout.strip().splitlines()[-1])
    # SIGKILL at the grace (1 s); Ray's default grace would be 5 s
    assert WORKER_KILL_GRACE_MS / 1000 <= seconds < 3.0, seconds


def test_the_helm_chart_and_cluster_files_set_the_same_grace():
    """One grace wherever raypipe deploys Ray (the cluster files are checked against the chart
    in tests/deployment/test_clusters.py)."""
    chart = yaml.safe_load((REPO / "helm" / "raypipe" / "values.yaml").read_text())
    assert chart["workerKillGraceMs"] == WORKER_KILL_GRACE_MS
