"""The jobs as users run them: ``jobs/train_tiny.py`` as a command, and
``jobs/train_7b.py --preset tiny`` submitted with ``ray job submit`` to a real Ray head.

Both run in their own processes and their own Ray instances, never in the
test session's: the tiny job gets ``RAY_ADDRESS=local`` (start a fresh local
instance even if some ``ray start`` cluster runs on this machine), and the head
started here uses its own ``--temp-dir``, so no other ``ray.init()`` on the
machine finds and joins it. CI runs the main job (``python jobs/train_tiny.py``,
writing ``runs/tiny``) before the tests: its outputs, when this code wrote them,
are checked instead of a second run. A bad config is named by ``raypipe train``
in-process (no process or Ray instance needed to read a YAML file).
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobs.job_summary import SHOWN, print_summary
from raypipe.checkpoint.store import latest_checkpoint, read_manifest
from raypipe.cli import main as raypipe_cli
from raypipe.data import prepare
from tests.deployment.ray_head import job_failure, ray_cli, wait_for_job
from tests.test_config import load_job

REPO = Path(__file__).resolve().parents[2]
UNIFORM_BYTE_LOSS = math.log(256)
# Uploaded with --working-dir: the code, not data, outputs or history ("/x" is
# anchored at the repository root, so raypipe/data/ is kept).
WORKING_DIR_EXCLUDES = ["/.git", "/data", "/runs", "/build", "/dist", "__pycache__", ".pytest_cache", "*.egg-info"]
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """2 MB of the stdlib, prepared once: a few thousand rows are plenty for 30 steps."""
    return prepare(tmp_path_factory.mktemp("data") / "stdlib-2mb", seq_len=256, max_bytes=2_000_000)


def _own_ray_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, RAY_ADDRESS="local", PYTHONUNBUFFERED="1", **extra)


# -- python jobs/train_tiny.py ------------------------------------------------------------

def main_job_outputs() -> Path | None:
    """``runs/tiny`` when it holds the outputs of ``python jobs/train_tiny.py`` as CI runs it (no
    flags: its default run config, trained from step 0 in one invocation), written after every
    file of the code that ran it; else None."""
    out = REPO / "runs" / "tiny"
    if not (out / "summary.json").exists():
        return None
    summary = json.loads((out / "summary.json").read_text())
    job = load_job("train_tiny")
    defaults = job["run_config"](job["parse_args"]([]))
    if (summary.get("first_step") != 0 or summary.get("steps") != defaults.steps
            or summary.get("steps_run") != defaults.steps
            or summary.get("pipeline") != json.loads(json.dumps(defaults.pipeline))):
        return None
    code = [*(REPO / "raypipe").rglob("*.py"), *(REPO / "jobs").glob("*.py")]
    newest_code = max(path.stat().st_mtime for path in code)
    return out if (out / "summary.json").stat().st_mtime > newest_code else None


@pytest.mark.cluster
def test_train_tiny_learns_and_writes_its_outputs(dataset, tmp_path):
    out = main_job_outputs()
    steps = 200 if out else 30
    if out is None:  # no fresh main job here: a shorter run of it, with every output the test reads
        out = tmp_path / "tiny"
        command = [sys.executable, "jobs/train_tiny.py", "--steps", str(steps), "--eval-every", "15", "--out",
                   str(out), "--no-progress", "--data", str(dataset)]
        done = subprocess.run(command, cwd=REPO, env=_own_ray_env(), capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and len(summary["losses"]) == steps
    assert summary["initial_loss"] > 5.0  # starts near uniform over bytes ...
    assert summary["final_loss"] < 4.0 < UNIFORM_BYTE_LOSS  # ... and learns well below it
    assert math.isfinite(summary["final_eval_loss"]) and summary["final_eval_loss"] < 4.5
    assert summary["tokens_per_second"] > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "trace.json").read_text())  # Chrome trace of the last step
    assert latest_checkpoint(out / "checkpoints") == steps  # the final checkpoint is complete
    assert read_manifest(out / "checkpoints", steps)["extra"]["dataset"]["next_step"] == steps


# -- ray job submit ... jobs/train_7b.py --preset tiny ---------------------------------------

@pytest.mark.cluster
def test_train_7b_tiny_preset_through_ray_job_submit(ray_head, dataset, tmp_path):
    url, env = ray_head.url, ray_head.env
    job_id = f"raypipe-test-{secrets.token_hex(4)}"
    out = tmp_path / "job"
    submit = [ray_cli(), "job", "submit", "--address", url, "--submission-id", job_id, "--no-wait",
              "--working-dir", ".", "--runtime-env-json", json.dumps({"excludes": WORKING_DIR_EXCLUDES}),
              "--", sys.executable, "jobs/train_7b.py", "--preset", "tiny", "--steps", "3",
              "--data", str(dataset), "--out", str(out)]
    done = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"

    status, logs = wait_for_job(url, job_id, env, JOB_TIMEOUT_S)
    assert status == "SUCCEEDED", job_failure(job_id, f"{status} after up to {JOB_TIMEOUT_S}s", logs)

    # one line per step in the job's log (no terminal there, so no progress bar)
    steps = re.findall(r"^step (\d+)/3 loss (\S+) ", logs, flags=re.MULTILINE)
    assert [int(step) for step, _ in steps] == [1, 2, 3], logs[-6000:]
    assert all(math.isfinite(float(loss)) for _, loss in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "tiny" and summary["steps"] == 3
    assert summary["pipeline"]["num_stages"] == 2 and summary["pipeline"]["use_gpu"] is False


@pytest.mark.cluster
def test_raypipe_train_runs_a_yaml_config_of_two_replicas_of_two_stages(dataset, tmp_path):
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config.update(data=str(dataset), steps=8, eval_every=8, progress=False)
    config["pipeline"].update(num_replicas=2, num_micro_batches=2)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    # 4 workers on a 2-core machine: the local Ray instance the run starts gets a logical CPU per worker
    completed = subprocess.run([sys.executable, "-m", "raypipe.cli", "train", "--config", str(path), "--out", str(out)],
                               cwd=REPO, env=_own_ray_env(), capture_output=True, text=True, timeout=400)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["final_loss"] < summary["initial_loss"]
    assert math.isfinite(summary["final_eval_loss"])
    rows = {event["args"]["name"] for event in json.loads((out / "trace.json").read_text())["traceEvents"]
            if event["name"] == "process_name"}
    assert rows == {f"replica {r}, stage {s}" for r in range(2) for s in range(2)}
    assert latest_checkpoint(out / "checkpoints") == 8


def test_raypipe_train_names_a_bad_config_key(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny\nstepz: 3\n")
    assert raypipe_cli(["train", "--config", str(path)]) != 0
    assert "stepz" in capsys.readouterr().err


def test_raypipe_train_names_the_new_name_of_a_renamed_key(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text("model: tiny\npipeline:\n  num_stages: 2\n  checkpoint: always\n")
    status, stderr = raypipe_cli(["train", "--config", str(path)]), capsys.readouterr().err
    assert status == 2, stderr[-3000:]
    assert "invalid checkpoint='always': renamed to activation_checkpoint" in stderr


def test_both_jobs_print_the_run_summary_through_one_function(capsys):
    for name in ("train_tiny", "train_7b"):
        assert load_job(name)["print_summary"] is print_summary
    summary = {"num_parameters": 10, "steps": 3, "steps_run": 2, "initial_loss": 5.5, "final_loss": 4.0,
               "final_eval_loss": math.nan, "tokens_per_second": 100.0, "checkpoint_dir": "ck", "losses": [5.5, 4.0]}
    print_summary(summary, "out")
    text = capsys.readouterr().out
    shown, where = text[:text.rindex("}") + 1], text[text.rindex("}") + 1:]
    assert json.loads(shown).keys() == set(SHOWN) and json.loads(shown)["final_loss"] == 4.0
    assert where.strip() == "outputs in out: summary.json loss.png trace.json timeline.png; checkpoints in ck"
    print_summary({**summary, "steps_run": 0}, "out")  # nothing trained: the resume line said so
    assert capsys.readouterr().out == ""
