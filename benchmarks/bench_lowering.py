"""How long a schedule takes to build, lower and dry-run (``make_schedule``, what the
controller does before a run's first step and after every resize that changes a
replica's micro-batches, and what the planner does per candidate): this checkout vs
``--baseline``, another raypipe checkout (its root). With ``--worker``, what a stage
worker spends on its lowering as it starts: stage 0's spec as the driver ships it
(``replica_specs``: its lowered ops in it) against the same spec without them, which the
worker lowers itself (what every worker did before the driver shipped them).

Each trial is a process of its own (nothing cached from another trial) that builds
one schedule and lowers it; it reports its CPU seconds and a digest of the lowering,
so the two checkouts' lowerings are also compared op for op. The contenders take
turns (A B, B A, ...). Figures: per case each contender's CPU seconds (median
[min-max] over rounds) and the per-round ratios baseline/this.

    python benchmarks/bench_lowering.py --rounds 3 --baseline /tmp/raypipe-before
    python benchmarks/bench_lowering.py --rounds 1 --cases interleaved_1f1b:64:292:2
    python benchmarks/bench_lowering.py --rounds 3 --worker
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from alternate import command_line, print_table, round_ratios, run_rounds, spread

REPO = Path(__file__).resolve().parent.parent
# (schedule, p, m, v): interleaved 1F1B with m not a multiple of p (torch's flexible order, rounds of
# more than p micro-batches), then controls whose m is a multiple of p, zbv and zb_h1
CASES = ("interleaved_1f1b:16:42:2", "interleaved_1f1b:24:66:2", "interleaved_1f1b:32:90:2",
         "interleaved_1f1b:8:15:4", "interleaved_1f1b:32:128:2", "zbv:16:64:2", "zb_h1:16:64:1")
TRIAL = """
import hashlib, json, sys, time
import raypipe
from raypipe.core.lowering import lower
from raypipe.core.schedule import PLACEMENT, make_schedule
name, p, m, v = sys.argv[1], *map(int, sys.argv[2:5])
start = time.process_time()
schedule = make_schedule(name, p, m, v)
seconds = time.process_time() - start
digest = hashlib.sha256(repr(lower(schedule, PLACEMENT[name])).encode()).hexdigest()[:16]
print(json.dumps({"seconds": seconds, "lowering": digest, "raypipe": raypipe.__file__}))
"""

WORKER_TRIAL = """
import hashlib, json, pickle, sys, time
import raypipe
spec = pickle.load(open(sys.argv[1], "rb"))
start = time.process_time()
lowered = spec.lowered_ops()
seconds = time.process_time() - start
print(json.dumps({"seconds": seconds, "lowering": hashlib.sha256(repr(lowered).encode()).hexdigest()[:16],
                  "raypipe": raypipe.__file__}))
"""


def run_trial(code: Path, script: str, arguments: list[str], what: str) -> dict:
    """One process of checkout ``code`` running ``script`` with ``arguments``: what it printed (its CPU
    seconds and its lowering's digest), checked to have imported that checkout's raypipe."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    # run in the checkout: ``python -c`` puts the working directory first on the path
    done = subprocess.run([sys.executable, "-c", script, *arguments], env=env, cwd=code, capture_output=True,
                          text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} in {code} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["raypipe"]).resolve().is_relative_to(code.resolve()):
        raise RuntimeError(f"the trial of {code} imported raypipe from {result['raypipe']}")
    return result


def trial(code: Path, case: str) -> dict:
    """One process of checkout ``code`` building ``case``; its CPU seconds and lowering's digest."""
    return run_trial(code, TRIAL, case.split(":"), case)


def worker_trial(spec_file: Path) -> dict:
    """One process of this checkout taking the pickled spec in ``spec_file`` as a stage worker
    does: its CPU seconds to have its lowered ops."""
    return run_trial(REPO, WORKER_TRIAL, [str(spec_file)], str(spec_file))


def worker_specs(case: str, directory: Path) -> dict[str, Path]:
    """Stage 0's spec of ``case`` as the driver ships it, and without its lowered ops, pickled."""
    from torch import nn

    from raypipe import PipelineConfig
    from raypipe.control.elastic import replica_specs
    from raypipe.stage.spec import WorkerSpec

    name, p, m, v = case.split(":")
    config = PipelineConfig(num_stages=int(p), num_micro_batches=int(m), schedule=name, virtual_stages=int(v))
    stages = [WorkerSpec(stage, int(p), (nn.Identity(),), (stage,), config) for stage in range(int(p))]
    shipped = replica_specs(stages, 1, int(m))[0]
    files = {}
    for label, spec in (("shipped", shipped), ("lowered by the worker", dataclasses.replace(shipped, lowered=()))):
        files[label] = directory / f"{case.replace(':', '_')}_{len(files)}.pkl"
        files[label].write_bytes(pickle.dumps(spec))
    return files


def main_worker(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for case in args.cases:
            files = worker_specs(case, Path(directory))

            def contender(label: str, files: dict = files):
                return lambda count: [worker_trial(files[label]) for _ in range(count)]

            results = run_rounds({label: contender(label) for label in files}, args.rounds, 1, 0,
                                 reverse_odd_rounds=True)
            seconds = {label: [result["seconds"] for result in results[label]] for label in files}
            same = len({result["lowering"] for values in results.values() for result in values}) == 1
            row = [case, *(spread([1e3 * value for value in seconds[label]], 3) for label in files),
                   "yes" if same else "NO"]
            rows.append(row)
            print(" | ".join(map(str, row)), flush=True)
    print()
    print_table(["schedule:p:m:v", *(f"{label}, ms" for label in ("shipped", "lowered by the worker")),
                 "one lowering"], rows)
    print(command_line())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="trials per contender and case (default 3)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), metavar="SCHEDULE:P:M:V",
                        help=f"schedules to build (default {' '.join(CASES)})")
    parser.add_argument("--baseline", type=Path, help="another raypipe checkout to compare with (its root)")
    parser.add_argument("--worker", action="store_true",
                        help="a stage worker's lowering at its start, shipped by the driver / lowered itself")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(command_line())
    if args.worker:
        main_worker(args)
        return
    checkouts = {"this": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    rows, digests = [], {}
    for case in args.cases:
        def contender(name: str, case: str = case):
            return lambda count: [trial(checkouts[name], case) for _ in range(count)]

        results = run_rounds({name: contender(name) for name in checkouts}, args.rounds, 1, 0,
                             reverse_odd_rounds=True)
        seconds = {name: [result["seconds"] for result in results[name]] for name in checkouts}
        digests[case] = {result["lowering"] for values in results.values() for result in values}
        row = [case, *(spread(seconds[name], 2) for name in checkouts)]
        if "baseline" in checkouts:
            row.append(spread(round_ratios(seconds["baseline"], seconds["this"], 1)))
        row.append("yes" if len(digests[case]) == 1 else "NO")
        rows.append(row)
        print(" | ".join(map(str, row)), flush=True)
    print()
    print_table(["schedule:p:m:v", *(f"{name} CPU s" for name in checkouts),
                 *(["baseline/this"] if "baseline" in checkouts else []), "one lowering"], rows)
    print(command_line())


if __name__ == "__main__":
    main()
