#!/usr/bin/env bash
# raypipe's GPU check: one script, at most ~8 minutes on one GPU.
#
#   bash scripts/gpu_check.sh            # on a machine with a CUDA GPU
#   bash scripts/gpu_check.sh --dry-run  # anywhere: every step that needs no CUDA, and what it would run
#   bash scripts/gpu_check.sh --calibrate  # also the predictor's calibration (at most ~4 minutes more)
#
# Steps: 1. versions (torch, CUDA, NCCL, flash-attn, Ray; a missing one is reported and skipped)
#        2. every single-GPU test: python -m pytest -q -m "gpu and not gpus2 and not gpus4" over the files that mark one
#        3. one-process probes (scripts/gpu_probes.py): NCCL world size 1 join/all-reduce/abort/rejoin;
#           a bf16 LLaMA stage with recompute and offload under set_sync_debug_mode("warn");
#           flash-attn vs SDPA at 7B shapes, each backward run twice and compared bitwise;
#           a Ray run at p=1 with snapshots on and off (step time of each)
#        4. with --calibrate (scripts/gpu_calibrate.py): a LLaMA 1B's per-layer F, I and W times in bf16,
#           whole-model MFU and pinned host<->device bandwidth, each beside the predictor's figure; where
#           two GPUs exist, also one block split over both (--tensor-parallel 2: F/I/W and its collectives)
# Tests marked gpus2 need two GPUs: run them where there are two with
#   python -m pytest -q -m gpus2 tests (and -m gpus4 where there are four)
# The dry run lists the tests, imports the probes (naming them) and runs the CPU path of the
# probes that need no Ray (--dry-run --full: all of them, ~1-2 minutes more).
# Exit status: 0 when every step passed, 1 when one failed, 2 for a usage error.
set -u -o pipefail

DRY_RUN=0
FULL=0
CALIBRATE=0
for argument in "$@"; do
  case "$argument" in
    --dry-run) DRY_RUN=1 ;;
    --full) FULL=1 ;;
    --calibrate) CALIBRATE=1 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$argument' (use --dry-run, --full, --calibrate or --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.." || exit 2
PYTHON="${PYTHON:-python}"
OUT="${GPU_CHECK_OUT:-/tmp/raypipe_gpu_check}"
mkdir -p "$OUT"
TESTS_TIMEOUT_S=300   # budget: tests 5 min + probes 2.5 min + versions, under 8 minutes
PROBES_TIMEOUT_S=150
CALIBRATE_TIMEOUT_S=240  # --calibrate: at most 4 minutes more
declare -a SUMMARY=()
FAILED=0

step() {  # step NAME COMMAND...: run, time, record
  local name="$1"; shift
  local start end status
  echo "== $name: $*"
  start=$(date +%s)
  "$@"
  status=$?
  end=$(date +%s)
  if [ "$status" -eq 0 ]; then SUMMARY+=("ok     $name ($((end - start)) s)")
  else SUMMARY+=("FAILED $name ($((end - start)) s, exit $status)"); FAILED=1; fi
}

versions() {
  "$PYTHON" - <<'EOF'
import platform
print(f"python       {platform.python_version()}")
try:
    import torch
except ImportError:
    print("torch        not installed (skipped: nothing else can run)")
    raise SystemExit(1)
print(f"torch        {torch.__version__}")
print(f"CUDA         {torch.version.cuda or 'none (a CPU build of torch)'}")
try:
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    print(f"NCCL         {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl or 'not available here (skipped)'}")
except Exception as error:  # noqa: BLE001
    print(f"NCCL         not available ({type(error).__name__}; skipped)")
if torch.cuda.is_available():
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        print(f"GPU {index}        {torch.cuda.get_device_name(index)} (sm_{major}{minor}, "
              f"{torch.cuda.get_device_properties(index).total_memory / 2**30:.0f} GiB)")
else:
    print("GPU          none visible to torch")
for package in ("flash_attn", "ray"):
    try:
        module = __import__(package)
        print(f"{package:<12} {getattr(module, '__version__', 'unknown version')}")
    except Exception as error:  # noqa: BLE001 - not installed, or built against another CUDA/torch
        print(f"{package:<12} not importable ({type(error).__name__}: {str(error).splitlines()[0][:80]}; skipped)")
EOF
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  else
    echo "nvidia-smi   not found (driver version unknown)"
  fi
}

# Only the files that mark a test gpu are collected: the whole suite's collection is slow, and
# some of its modules import packages a GPU image need not have (helm-python-sdk, say), whose
# collection error would stop every GPU test from running.
gpu_test_files() {
  grep -rlE 'mark\.gpu' tests --include='test_*.py' | sort
}

list_gpu_tests() {
  RAYPIPE_LIST_GPU_TESTS=1 "$PYTHON" -m pytest -q -p no:cacheprovider -n0 --collect-only -m "gpu and not gpus2 and not gpus4" \
    $(gpu_test_files) | grep -E '::|collected|deselected'
}

step versions versions
if [ "$DRY_RUN" -eq 1 ]; then
  echo "== dry run: no CUDA needed; the GPU run would execute:"
  echo "   timeout $TESTS_TIMEOUT_S $PYTHON -m pytest -q -n0 -m \"gpu and not gpus2 and not gpus4\" <the test files that mark a test gpu>"
  echo "   timeout $PROBES_TIMEOUT_S $PYTHON scripts/gpu_probes.py --out $OUT/probes.json"
  step "list single-GPU tests" list_gpu_tests
  if [ "$FULL" -eq 1 ]; then
    step "probes, CPU path" timeout "$PROBES_TIMEOUT_S" "$PYTHON" scripts/gpu_probes.py --cpu --out "$OUT/probes_cpu.json"
  else
    step "probes without Ray, CPU path" timeout "$PROBES_TIMEOUT_S" "$PYTHON" scripts/gpu_probes.py --cpu \
      --only nccl_world1 flash_vs_sdpa --out "$OUT/probes_cpu.json"
  fi
  if [ "$CALIBRATE" -eq 1 ]; then
    echo "   timeout $CALIBRATE_TIMEOUT_S $PYTHON scripts/gpu_calibrate.py --out $OUT/calibrate.json"
    step "calibration, CPU path" timeout "$CALIBRATE_TIMEOUT_S" "$PYTHON" scripts/gpu_calibrate.py --cpu \
      --out "$OUT/calibrate_cpu.json"
    echo "   timeout $CALIBRATE_TIMEOUT_S $PYTHON scripts/gpu_calibrate.py --tensor-parallel 2 --out $OUT/calibrate_tp2.json  (two GPUs only)"
  fi
else
  if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: torch sees no CUDA GPU here; run with --dry-run for the steps that need none" >&2
    exit 1
  fi
  step "single-GPU tests" timeout "$TESTS_TIMEOUT_S" "$PYTHON" -m pytest -q -p no:cacheprovider -n0 -m "gpu and not gpus2 and not gpus4" \
    --durations=0 --junitxml "$OUT/tests.xml" $(gpu_test_files)
  step probes timeout "$PROBES_TIMEOUT_S" "$PYTHON" scripts/gpu_probes.py --out "$OUT/probes.json"
  if [ "$CALIBRATE" -eq 1 ]; then
    step calibration timeout "$CALIBRATE_TIMEOUT_S" "$PYTHON" scripts/gpu_calibrate.py --out "$OUT/calibrate.json"
    if "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)'; then
      step "tensor-parallel calibration (2 GPUs)" timeout "$CALIBRATE_TIMEOUT_S" "$PYTHON" scripts/gpu_calibrate.py \
        --tensor-parallel 2 --out "$OUT/calibrate_tp2.json"
    else
      echo "   tensor-parallel calibration: skipped (one GPU; --tensor-parallel 2 needs two on this node)"
    fi
  fi
fi

echo "== summary$([ "$DRY_RUN" -eq 1 ] && echo ' (dry run)'); results under $OUT"
printf '   %s\n' "${SUMMARY[@]}"
exit "$FAILED"
