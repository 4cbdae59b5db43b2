"""scripts/gpu_check.sh --dry-run: every step that needs no CUDA runs here, and says what the GPU run would."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_does_the_steps_that_need_no_cuda(tmp_path):
    start = time.monotonic()
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)})
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for version in ("torch ", "CUDA ", "NCCL ", "flash_attn ", "ray "):  # each reported, found or not
        assert f"\n{version}" in out or out.startswith(version), version
    assert 'pytest -q -n0 -m "gpu and not gpus2 and not gpus4" <the test files that mark a test gpu>' in out  # what it would run
    assert "tests/stage/test_device_timing.py::test_a_gpu_stage_times_its_ops_by_cuda_events" in out
    assert "test_zero1_over_nccl" not in out  # two-GPU tests are not in the single-GPU run
    probes = json.loads((tmp_path / "probes_cpu.json").read_text())
    assert set(probes) == {"nccl_world1", "flash_vs_sdpa"} and all(p["ok"] for p in probes.values())
    assert "summary (dry run)" in out and "FAILED" not in out
    assert seconds < 200, f"the dry run took {seconds:.0f} s"


def test_an_unknown_argument_is_named():
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dryrun"], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2
    assert done.stderr.startswith("gpu_check.sh: unknown argument '--dryrun'")


def test_a_host_sync_is_placed_at_the_raypipe_frames_that_asked_for_it():
    """The bf16 probe counts host syncs by where in raypipe they were asked for."""
    import importlib.util
    import traceback

    spec = importlib.util.spec_from_file_location("gpu_probes", REPO / "scripts" / "gpu_probes.py")
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)
    frame = lambda path, line, name: traceback.FrameSummary(str(REPO / path), line, name)  # noqa: E731
    stack = traceback.StackSummary.from_list([
        frame("scripts/gpu_probes.py", 130, "probe_bf16_stage"), frame("raypipe/stage/stage_op.py", 49, "wrapper"),
        frame("raypipe/stage/worker.py", 191, "forward"), ("/torch/nn/modules/module.py", 1, "_call_impl", None)])
    assert probes._raypipe_site(stack) == "stage/worker.py:191 forward <- stage/stage_op.py:49 wrapper"
    assert probes._raypipe_site(stack[:1]) == "scripts/gpu_probes.py:130 probe_bf16_stage"
