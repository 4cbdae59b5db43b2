"""The jobs as users run them: ``jobs/train_tiny.py`` as a command, and
``jobs/train_7b.py --preset tiny`` submitted with ``ray job submit`` to a real Ray head.

Both run in their own processes and their own Ray instances, never in the
test session's: the tiny job gets ``RAY_ADDRESS=local`` (start a fresh local
instance even if some ``ray start`` cluster runs on this machine), and the head
started here uses its own ``--temp-dir``, so no other ``ray.init()`` on the
machine finds and joins it.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from raypipe.checkpoint.store import latest_checkpoint, read_manifest
from raypipe.data import prepare

REPO = Path(__file__).resolve().parents[2]
UNIFORM_BYTE_LOSS = math.log(256)
# Uploaded with --working-dir: the code, not data, outputs or history ("/x" is
# anchored at the repository root, so raypipe/data/ is kept).
WORKING_DIR_EXCLUDES = ["/.git", "/data", "/runs", "/build", "/dist", "__pycache__", ".pytest_cache", "*.egg-info"]
HEAD_START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """2 MB of the stdlib, prepared once: a few thousand rows are plenty for 30 steps."""
    return prepare(tmp_path_factory.mktemp("data") / "stdlib-2mb", seq_len=256, max_bytes=2_000_000)


def _own_ray_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, RAY_ADDRESS="local", PYTHONUNBUFFERED="1", **extra)


# -- python jobs/train_tiny.py ------------------------------------------------------------

def test_train_tiny_learns_and_writes_its_outputs(dataset, tmp_path):
    out = tmp_path / "tiny"
    command = [sys.executable, "jobs/train_tiny.py", "--steps", "30", "--eval-every", "15", "--out", str(out),
               "--no-progress", "--data", str(dataset)]
    done = subprocess.run(command, cwd=REPO, env=_own_ray_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and len(summary["losses"]) == 30
    assert summary["initial_loss"] > 5.0  # starts near uniform over bytes ...
    assert summary["final_loss"] < 4.0 < UNIFORM_BYTE_LOSS  # ... and learns well below it
    assert math.isfinite(summary["final_eval_loss"]) and summary["final_eval_loss"] < 4.5
    assert summary["tokens_per_second"] > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "trace.json").read_text())  # Chrome trace of the last step
    assert latest_checkpoint(out / "checkpoints") == 30  # the final checkpoint is complete
    assert read_manifest(out / "checkpoints", 30)["extra"]["dataset"]["next_step"] == 30


def test_train_tiny_runs_two_replicas_of_two_stages(dataset, tmp_path):
    # 4 workers on a 2-core machine: the local Ray instance the job starts gets a logical CPU per worker
    out = tmp_path / "replicas"
    command = [sys.executable, "jobs/train_tiny.py", "--replicas", "2", "--stages", "2", "--micro-batches", "2",
               "--steps", "8", "--eval-every", "8", "--out", str(out), "--no-progress", "--data", str(dataset)]
    done = subprocess.run(command, cwd=REPO, env=_own_ray_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["final_loss"] < summary["initial_loss"]
    assert math.isfinite(summary["final_eval_loss"])
    rows = {event["args"]["name"] for event in json.loads((out / "trace.json").read_text())["traceEvents"]
            if event["name"] == "process_name"}
    assert rows == {f"replica {r}, stage {s}" for r in range(2) for s in range(2)}
    assert latest_checkpoint(out / "checkpoints") == 8


# -- ray job submit ... jobs/train_7b.py --preset tiny ---------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_cli() -> str:
    beside_python = Path(sys.executable).with_name("ray")
    found = str(beside_python) if beside_python.exists() else shutil.which("ray")
    assert found, "the `ray` command is missing (pip install 'ray[default]')"
    return found


def _session_members(session_id: int) -> list[int]:
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


def _stop_session(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop the head's processes only: `ray stop` would kill every Ray process on the machine.

    `ray start --block` ran in a session of its own; Ray's daemons and workers
    stay in it. The job's driver runs in its own session but is killed by a
    watcher when its supervisor actor dies.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_members(process.pid):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while _session_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    process.wait(timeout=grace_s)


def _wait_for_dashboard(process: subprocess.Popen, url: str, log: Path) -> None:
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
            time.sleep(1)
    pytest.fail(f"the Ray dashboard at {url} did not come up in {HEAD_START_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def ray_head():
    """A real Ray head (`ray start --head`) with its job server on 127.0.0.1.

    Every port is chosen here, so it does not collide with other Ray instances
    on the machine. It has a token of its own (Ray's token authentication),
    which the `ray job` commands get through the environment. Yields the job
    server URL and that environment.
    """
    temp_dir = tempfile.mkdtemp(prefix="rpj-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH"):  # they override --address
        env.pop(name, None)
    ports = {name: _free_port() for name in ("port", "dashboard-port", "ray-client-server-port",
                                               "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                               "runtime-env-agent-port", "metrics-export-port",
                                               "node-manager-port", "object-manager-port")}
    command = [_ray_cli(), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=2", "--num-gpus=0",
               "--object-store-memory=300000000", f"--temp-dir={temp_dir}", "--disable-usage-stats",
               *[f"--{name}={port}" for name, port in ports.items()]]
    log = Path(temp_dir) / "ray-start.log"
    with open(log, "w") as log_file:
        head = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=temp_dir,
                                start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        _wait_for_dashboard(head, url, log)
        yield url, env
    finally:
        _stop_session(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _job_status(url: str, job_id: str, env: dict[str, str]) -> str:
    script = ("import sys\nfrom ray.job_submission import JobSubmissionClient\n"
              "print(JobSubmissionClient(sys.argv[1]).get_job_status(sys.argv[2]).value)")
    done = subprocess.run([sys.executable, "-c", script, url, job_id], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_train_7b_tiny_preset_through_ray_job_submit(ray_head, dataset, tmp_path):
    url, env = ray_head
    job_id = f"raypipe-test-{secrets.token_hex(4)}"
    out = tmp_path / "job"
    submit = [_ray_cli(), "job", "submit", "--address", url, "--submission-id", job_id, "--no-wait",
              "--working-dir", ".", "--runtime-env-json", json.dumps({"excludes": WORKING_DIR_EXCLUDES}),
              "--", sys.executable, "jobs/train_7b.py", "--preset", "tiny", "--steps", "3",
              "--data", str(dataset), "--out", str(out)]
    done = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"

    deadline = time.monotonic() + JOB_TIMEOUT_S
    status = _job_status(url, job_id, env)
    while status in ("PENDING", "RUNNING") and time.monotonic() < deadline:
        time.sleep(3)
        status = _job_status(url, job_id, env)
    logs = subprocess.run([_ray_cli(), "job", "logs", "--address", url, job_id], env=env, capture_output=True,
                          text=True, timeout=60).stdout
    assert status == "SUCCEEDED", f"job {job_id} is {status} after up to {JOB_TIMEOUT_S}s; logs:\n{logs[-6000:]}"

    # one line per step in the job's log (no terminal there, so no progress bar)
    steps = re.findall(r"^step (\d+)/3 loss (\S+) ", logs, flags=re.MULTILINE)
    assert [int(step) for step, _ in steps] == [1, 2, 3], logs[-6000:]
    assert all(math.isfinite(float(loss)) for _, loss in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "tiny" and summary["steps"] == 3
    assert summary["pipeline"]["num_stages"] == 2 and summary["pipeline"]["use_gpu"] is False


def test_raypipe_train_runs_a_yaml_config(dataset, tmp_path):
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config.update(data=str(dataset), steps=3, eval_every=3, progress=False)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    completed = subprocess.run([sys.executable, "-m", "raypipe.cli", "train", "--config", str(path), "--out", str(out)],
                               cwd=REPO, env=_own_ray_env(), capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_loss"] < summary["initial_loss"]


def test_raypipe_train_names_a_bad_config_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny\nstepz: 3\n")
    completed = subprocess.run([sys.executable, "-m", "raypipe.cli", "train", "--config", str(path)],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0 and "stepz" in completed.stderr


def test_raypipe_train_names_the_new_name_of_a_renamed_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  checkpoint: always\n")
    completed = subprocess.run([sys.executable, "-m", "raypipe.cli", "train", "--config", str(path)],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2, completed.stderr[-3000:]
    assert "invalid checkpoint='always': renamed to activation_checkpoint" in completed.stderr
