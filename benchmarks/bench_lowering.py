"""How long a schedule takes to build, lower and dry-run (``make_schedule``, what the
controller and every stage worker do before a run's first step and after every
resize that changes a replica's micro-batches, and what the planner does per
candidate): this checkout vs ``--baseline``, another raypipe checkout (its root).

Each trial is a process of its own (nothing cached from another trial) that builds
one schedule and lowers it; it reports its CPU seconds and a digest of the lowering,
so the two checkouts' lowerings are also compared op for op. The contenders take
turns (A B, B A, ...). Figures: per case each contender's CPU seconds (median
[min-max] over rounds) and the per-round ratios baseline/this.

    python benchmarks/bench_lowering.py --rounds 3 --baseline /tmp/raypipe-before
    python benchmarks/bench_lowering.py --rounds 1 --cases interleaved_1f1b:64:292:2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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


def trial(code: Path, case: str) -> dict:
    """One process of checkout ``code`` building ``case``; its CPU seconds and lowering's digest."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    # run in the checkout: ``python -c`` puts the working directory first on the path
    done = subprocess.run([sys.executable, "-c", TRIAL, *case.split(":")], env=env, cwd=code, capture_output=True,
                          text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{case} in {code} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["raypipe"]).resolve().is_relative_to(code.resolve()):
        raise RuntimeError(f"the trial of {code} imported raypipe from {result['raypipe']}")
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="trials per contender and case (default 3)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), metavar="SCHEDULE:P:M:V",
                        help=f"schedules to build (default {' '.join(CASES)})")
    parser.add_argument("--baseline", type=Path, help="another raypipe checkout to compare with (its root)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(command_line())
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
