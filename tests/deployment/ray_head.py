"""A real `ray start --head` for tests, started and stopped by pid: `ray stop`
would kill every Ray process on the machine, other people's too."""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.ports import free_ports

HEAD_START_TIMEOUT_S = 120
# a head whose autoscaler runs Ray's fake multi-node provider, its monitor looping every second instead of
# every 5 s (as ray.cluster_utils.AutoscalingCluster runs it): the tests wait on its node launches and on
# `ray status`, which it rewrites once a loop
FAKE_AUTOSCALER_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
# every port a head opens, chosen here so that it collides with no other Ray instance on the machine
HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port", "node-manager-port",
              "object-manager-port")


def head_ports() -> dict[str, int]:
    """A free port for each of HEAD_PORTS, all different (``ray start`` refuses a port twice)."""
    return dict(zip(HEAD_PORTS, free_ports(len(HEAD_PORTS))))


def ray_cli() -> str:
    beside_python = Path(sys.executable).with_name("ray")
    found = str(beside_python) if beside_python.exists() else shutil.which("ray")
    assert found, "the `ray` command is missing (pip install 'ray[default]')"
    return found


def token_env(**extra: str) -> dict[str, str]:
    """This environment with a fresh token of Ray's token authentication, and no pointer to another cluster."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), **extra)
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH"):  # they override --address
        env.pop(name, None)
    return env


def session_members(session_id: int) -> list[int]:
    """Live processes of a session (zombies excluded: they are dead, only not yet reaped)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != session_id:
                continue
            if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                members.append(int(entry))
        except OSError:  # exited meanwhile
            continue
    return members


def stop_session(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop the head's processes only.

    `ray start --block` ran in a session of its own; Ray's daemons and workers
    (and the raylets of fake nodes, which the head's autoscaler starts) stay in
    it. The job's driver runs in its own session but is killed by a watcher when
    its supervisor actor dies.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_members(process.pid):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while session_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    process.wait(timeout=grace_s)


def wait_for_dashboard(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"ray start exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:  # answering (e.g. 401 without a token): it is up
            return
        except OSError:
            time.sleep(0.25)  # one HTTP request a poll: the head is up a fraction of a second sooner
    pytest.fail(f"the Ray dashboard at {url} did not come up in {HEAD_START_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")


def start_head(temp_dir: str, env: dict[str, str], ports: dict[str, int], *options: str) -> subprocess.Popen:
    """`ray start --head --block` in a session of its own, on 127.0.0.1, logging to TEMP_DIR/ray-start.log."""
    command = [ray_cli(), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
               "--include-dashboard=true", "--num-gpus=0", f"--temp-dir={temp_dir}", "--disable-usage-stats",
               *[f"--{name}={port}" for name, port in ports.items()], *options]
    with open(Path(temp_dir) / "ray-start.log", "w") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=temp_dir,
                                start_new_session=True)


# one process polls (each would otherwise import ray: a second of CPU, taken from the job it waits for)
@contextlib.contextmanager
def fake_autoscaling_head(temp_dir: str, ports: dict[str, int], config: dict, env: dict[str, str]) -> Iterator[str]:
    """The head of Ray's fake autoscaling cluster, ``ray start``ed with the launcher YAML ``config``
    (written into ``temp_dir``): its GCS address, until the session is stopped (asserting none of its
    processes is left) and ``temp_dir`` removed."""
    config_path = Path(temp_dir) / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    head = start_head(temp_dir, env, ports, "--num-cpus=0", f"--autoscaling-config={config_path}")
    try:
        wait_for_dashboard(head, f"http://127.0.0.1:{ports['dashboard-port']}", Path(temp_dir) / "ray-start.log")
        yield f"127.0.0.1:{ports['port']}"
    finally:
        stop_session(head)
        assert session_members(head.pid) == []
        shutil.rmtree(temp_dir, ignore_errors=True)


_WAIT_FOR_JOB = """
import sys, time
from ray.job_submission import JobSubmissionClient
client, deadline = JobSubmissionClient(sys.argv[1]), time.monotonic() + float(sys.argv[3])
status = client.get_job_status(sys.argv[2]).value
while status in ("PENDING", "RUNNING") and time.monotonic() < deadline:
    time.sleep(0.25)
    status = client.get_job_status(sys.argv[2]).value
print(status)
"""


def wait_for_job(url: str, job_id: str, env: dict[str, str], timeout_s: float) -> tuple[str, str]:
    """The job's final status (or its status after ``timeout_s``) and its logs."""
    done = subprocess.run([sys.executable, "-c", _WAIT_FOR_JOB, url, job_id, str(timeout_s)], env=env,
                          capture_output=True, text=True, timeout=timeout_s + 60)
    assert done.returncode == 0, done.stderr[-3000:]
    status = done.stdout.strip().splitlines()[-1]
    logs = subprocess.run([ray_cli(), "job", "logs", "--address", url, job_id], env=env, capture_output=True,
                          text=True, timeout=60).stdout
    return status, logs


_WORKER_LINE = re.compile(r"^(\x1b\[\d+m)?\([^)]* pid=\d+")


def job_failure(job_id: str, status: str, logs: str) -> str:
    """A failed job's story for an assertion: the driver's own lines (its traceback), then the
    tail of every line; a worker's crash report fills a plain tail and hides why the driver ended."""
    driver = "\n".join(line for line in logs.splitlines() if not _WORKER_LINE.match(line))
    return f"job {job_id} is {status}; the driver's lines:\n{driver[-5000:]}\nthe logs' tail:\n{logs[-2000:]}"
