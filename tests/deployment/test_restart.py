"""A lost driver or head costs only the steps since the newest intact checkpoint.

What a RayJob retry (``backoffLimit``) or a user does after the driver or the
head died: run the same ``jobs/train_7b.py`` command again. It must resume from
the newest intact checkpoint and finish the same run: the same total steps, the
final parameters, optimizer and LR-schedule state bitwise those of an
uninterrupted run, each step trained on its own data once in the state that
persists.

One test covers both failures, to keep suite time (each Ray start costs ~25 s
on 2 busy cores): on the deployment tests' shared ``ray start --head`` a first
driver is SIGKILLed (driver death, the head lives); the rerun, on a head of its
own, loses that head (every head process and the driver, as when a head pod
goes); the newest checkpoint is then damaged, and the rerun on another head
(the shared one again) resumes from the one before it. The reference is the same run config trained uninterrupted in the
test session's Ray instance. Every process is stopped by pid, never `ray stop`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raypipe.checkpoint.store import MANIFEST, list_checkpoints, read_layer, read_manifest, step_dir_name
from raypipe.data import prepare
from raypipe.run import train
from tests.deployment.conftest import SharedHead
from tests.deployment.ray_head import head_ports, session_members, start_head, token_env, wait_for_dashboard
from tests.reference import assert_bitwise_equal
from tests.test_config import load_job

REPO = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY = 16, 2
STEP_TIMEOUT_S = 240  # a driver's start (connect, place 2 stages) plus a few steps on a loaded 2-core machine


def job_flags(data: Path, out: Path) -> list[str]:
    """The command every run repeats: the tiny preset, made fast (fp32, no recompute, small steps)."""
    return ["--preset", "tiny", "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY),
            "--micro-batches", "2", "--micro-batch-size", "1", "--precision", "fp32",
            "--activation-checkpoint", "never", "--eval-every", "0", "--no-progress",
            "--data", str(data), "--out", str(out)]


class Head:
    """A `ray start --head` of its own (ports, temp dir, token), stopped by pid."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rpr-", dir="/tmp")  # short: socket paths must fit 107 bytes
        self.env = token_env(PYTHONPATH=str(REPO))
        ports = head_ports()
        self.address = f"127.0.0.1:{ports['port']}"
        self.process = start_head(self.temp_dir, self.env, ports, "--num-cpus=2", "--object-store-memory=200000000")
        wait_for_dashboard(self.process, f"http://127.0.0.1:{ports['dashboard-port']}",
                           Path(self.temp_dir) / "ray-start.log")

    def kill(self) -> None:
        """SIGKILL every process of the head's session, as when its pod or machine goes."""
        deadline = time.monotonic() + 30
        while (members := session_members(self.process.pid)) and time.monotonic() < deadline:
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:  # exited meanwhile
                    pass
            time.sleep(0.2)
        self.process.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_driver(head: Head | SharedHead, flags: list[str], log: Path) -> subprocess.Popen:
    """``python jobs/train_7b.py FLAGS`` attached to ``head``, in a session of its own."""
    with open(log, "w") as log_file:
        return subprocess.Popen([sys.executable, "jobs/train_7b.py", *flags], cwd=REPO,
                                env=dict(head.env, RAY_ADDRESS=head.address), stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_checkpoint(driver: subprocess.Popen, checkpoints: Path, step: int, log: Path) -> None:
    """Until the checkpoint of ``step`` (or a later one) is complete, polled closely: a step takes ~0.3 s."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not any(s >= step for s in _complete(checkpoints)):
        assert driver.poll() is None, f"the driver exited ({driver.returncode}) early:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} after {STEP_TIMEOUT_S}s:\n" \
                                            f"{log.read_text()[-4000:]}"
        time.sleep(0.02)


def kill_driver(driver: subprocess.Popen) -> None:
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)


def newest_before_the_end(checkpoints: Path, log: Path) -> int:
    newest = max(_complete(checkpoints))
    assert newest < STEPS, f"the kill came after the run's last checkpoint:\n{log.read_text()[-4000:]}"
    return newest


def _complete(checkpoints: Path) -> list[int]:
    return list_checkpoints(checkpoints) if checkpoints.exists() else []


def logged_steps(log: str) -> list[tuple[int, float]]:
    """The job's ``step N/STEPS loss L`` lines: (0-based step, loss to 4 decimals)."""
    found = re.findall(rf"^step (\d+)/{STEPS} loss (\S+) ", log, flags=re.MULTILINE)
    return [(int(step) - 1, float(loss)) for step, loss in found]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("data") / "stdlib", seq_len=256, max_bytes=300_000)


@pytest.fixture(scope="module")
def reference(ray_cluster, data, tmp_path_factory) -> tuple[Path, dict]:
    """The same command's run config, trained uninterrupted in the session's Ray instance."""
    out = tmp_path_factory.mktemp("reference")
    job = load_job("train_7b")
    return out / "checkpoints", train(job["run_config"](job["parse_args"](job_flags(data, out))))


@pytest.mark.cluster
def test_a_rerun_after_driver_and_head_death_finishes_the_same_run_bitwise(reference, data, tmp_path, ray_head):
    reference_checkpoints, reference_summary = reference
    out, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    flags = job_flags(data, out)
    # 1. the driver dies (SIGKILL), its head (the shared one) lives
    first = start_driver(ray_head, flags, tmp_path / "run1.log")
    try:
        wait_for_checkpoint(first, checkpoints, CHECKPOINT_EVERY, tmp_path / "run1.log")
    finally:
        kill_driver(first)
    resumed_1 = newest_before_the_end(checkpoints, tmp_path / "run1.log")
    # 2. the same command on a head of its own; a few checkpoints later that head dies: every
    # process of it, and the driver (on the head pod) with it
    head = Head()
    second = start_driver(head, flags, tmp_path / "run2.log")
    try:
        wait_for_checkpoint(second, checkpoints, resumed_1 + 2 * CHECKPOINT_EVERY, tmp_path / "run2.log")
    finally:
        head.kill()
        kill_driver(second)
    newest_before_the_end(checkpoints, tmp_path / "run2.log")
    # 3. the newest checkpoint is damaged: the rerun on another head resumes from the one before
    intact = _complete(checkpoints)
    newest, resumed_3 = intact[-1], intact[-2]
    (checkpoints / step_dir_name(newest) / "layer_00000.pt").write_bytes(b"damaged")
    third = start_driver(ray_head, flags, tmp_path / "run3.log")
    try:
        assert third.wait(timeout=STEP_TIMEOUT_S) == 0, (tmp_path / "run3.log").read_text()[-6000:]
    finally:
        if third.poll() is None:
            kill_driver(third)

    logs = [(tmp_path / f"run{n}.log").read_text() for n in (1, 2, 3)]
    assert f"resuming from the checkpoint of step {resumed_1} " in logs[1], logs[1][-3000:]
    assert f"checkpoint step {newest} is damaged" in logs[2] and "layer_00000.pt" in logs[2], logs[2][-3000:]
    assert f"resuming from the checkpoint of step {resumed_3} " in logs[2], logs[2][-3000:]
    # each invocation trains the steps after its checkpoint, none before: no gap, no repeat within a run
    expected_losses = reference_summary["losses"]
    for log, start in zip(logs, (0, resumed_1, resumed_3)):
        steps = logged_steps(log)
        assert [step for step, _ in steps] == list(range(start, start + len(steps))), log[-3000:]
        assert all(loss == round(expected_losses[step], 4) for step, loss in steps), (steps, expected_losses)
    assert logged_steps(logs[2])[-1][0] == STEPS - 1
    # the final invocation's summary covers its steps, at full precision, and the run's total
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["first_step"], summary["resumed_from_step"]) == (STEPS, resumed_3, resumed_3)
    assert summary["losses"] == expected_losses[resumed_3:]
    # the final state: parameters, optimizer and LR schedule of every layer, and the data position
    final, expected = read_manifest(checkpoints, STEPS), read_manifest(reference_checkpoints, STEPS)
    assert final["extra"]["dataset"] == expected["extra"]["dataset"]
    assert final["extra"]["step_count"] == expected["extra"]["step_count"] == STEPS
    for layer in range(expected["num_layers"]):
        assert_bitwise_equal(read_layer(checkpoints, STEPS, layer), read_layer(reference_checkpoints, STEPS, layer),
                             f"layer {layer}")
    # the same cadence as the uninterrupted run: the damaged checkpoint was deleted and saved again
    assert list_checkpoints(checkpoints) == list_checkpoints(reference_checkpoints) == list(
        range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    assert (checkpoints / step_dir_name(STEPS) / MANIFEST).exists()


def test_a_finished_run_reruns_as_nothing_to_do_and_a_foreign_checkpoint_dir_is_refused(reference, data):
    reference_checkpoints, _ = reference
    out = reference_checkpoints.parent
    job = load_job("train_7b")
    run = job["run_config"](job["parse_args"](job_flags(data, out)))
    written = (out / "summary.json").stat().st_mtime_ns
    summary = train(run)
    assert (summary["steps"], summary["steps_run"], summary["first_step"]) == (STEPS, 0, STEPS)
    assert (out / "summary.json").stat().st_mtime_ns == written  # nothing rewritten
    # refused before any actor starts: a fresh start over these checkpoints, and a run shorter than them
    with pytest.raises(ValueError, match=f"holds checkpoints of an earlier run \\(the newest: step {STEPS}\\)"):
        train(dataclasses.replace(run, resume=False))
    with pytest.raises(ValueError, match=f"holds step {STEPS}, past the run's steps={STEPS - 1}"):
        train(dataclasses.replace(run, steps=STEPS - 1))
