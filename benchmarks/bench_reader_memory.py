"""A reading stage's memory and read time over a run's steps: this checkout
(decoded shards memory-mapped from the node's disk) vs ``--baseline``, another
raypipe checkout (e.g. the one before, which held every decoded shard in the
reading process), CPU.

Each trial is a process of its own that opens the main job's dataset (the
standard-library corpus, 29 train shards of 4096 rows of 257 tokens, prepared
first if missing) as a first stage does (micro-batches of 4, 4 per step) and
reads ``--steps`` steps in order. Printed per trial: the growth of the
process's anonymous resident memory (``RssAnon``: what the kernel cannot take
back; a mapped file's pages are ``RssFile``, page cache it may drop), and the
seconds the reads took (and those the dataset took to open):

- ``cold``: a new node (an empty ``RAYPIPE_CACHE`` for the decoded copies);
- ``warm``: a second reader on the same node (the copies the cold one wrote);
- ``shipped``: a cold reader of a shipped copy (shards from Ray's object store,
  in a local Ray instance of the trial's own).

The contenders take turns (A B, B A, ...). Figures: per round the ratios
baseline/this of the read seconds, and each contender's memory growth.

    python benchmarks/bench_reader_memory.py --rounds 4 --steps 200 --baseline /tmp/raypipe-before
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from alternate import command_line, print_table, round_ratios, run_rounds, spread
from bench_job_throughput import add_data_argument

REPO = Path(__file__).resolve().parent.parent
KINDS = ("cold", "warm", "shipped")

TRIAL = r"""
import json, os, sys, time

def anonymous_kb():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["RssAnon"].split()[0]), int(fields["RssFile"].split()[0])

from raypipe.data import TokenDataset
kind, data, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
opening = time.perf_counter()
dataset = TokenDataset(data, micro_batch_size=4, num_micro_batches=4)
open_seconds = time.perf_counter() - opening
if kind == "shipped":
    import ray
    from raypipe.data.shipping import ship
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    dataset = ray.get(ray.put(ship(dataset)))
anonymous_before, _ = anonymous_kb()
start = time.perf_counter()
for step in range(steps):
    for micro_batch in range(4):
        dataset.get(step, micro_batch)
seconds = time.perf_counter() - start
anonymous_after, file_after = anonymous_kb()
print(json.dumps({"seconds": seconds, "open_seconds": open_seconds,
                  "anonymous_mb": (anonymous_after - anonymous_before) / 1024, "file_mb": file_after / 1024}))
"""


def trial(code: Path, kind: str, data: Path, steps: int, cache: Path) -> dict:
    """One reader process of checkout ``code``; its figures."""
    env = {**os.environ, "PYTHONPATH": str(code), "RAYPIPE_CACHE": str(cache), "RAY_ADDRESS": "local"}
    # run in the checkout: ``python -c`` puts the working directory first on the path, so from another
    # checkout's root both contenders would import that one
    done = subprocess.run([sys.executable, "-c", TRIAL, kind, str(Path(data).resolve()), str(steps)], env=env,
                          cwd=code, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} trial of {code} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="trials per contender and kind (default 4)")
    parser.add_argument("--steps", type=int, default=200, help="steps each reader reads (default 200, the main job's)")
    parser.add_argument("--baseline", type=Path, help="another raypipe checkout to compare with (its root)")
    add_data_argument(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(command_line())
    checkouts = {"this": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    with tempfile.TemporaryDirectory(prefix="raypipe_reader_bench_") as scratch:
        trials = {name: 0 for name in checkouts}

        def contender(name: str):
            def run(count: int) -> list[dict]:
                values = []
                for _ in range(count):
                    trials[name] += 1
                    cache = Path(scratch) / f"{name}-{trials[name]}"  # a new node: nothing decoded yet
                    values.append({kind: trial(checkouts[name], kind, args.data, args.steps,
                                               cache / ("shipped" if kind == "shipped" else "files"))
                                   for kind in KINDS})
                return values
            return run

        results = run_rounds({name: contender(name) for name in checkouts}, args.rounds, 1, 0,
                             reverse_odd_rounds=True)
    print()
    header = ["round"] + [f"{name} {kind} s / RssAnon MB" for name in checkouts for kind in KINDS]
    print_table(header, [[index + 1, *(f"{results[name][index][kind]['seconds']:.2f} / "
                                       f"{results[name][index][kind]['anonymous_mb']:.0f}"
                                       for name in checkouts for kind in KINDS)] for index in range(args.rounds)])
    for name in checkouts:
        for kind in KINDS:
            growth = [result[kind]["anonymous_mb"] for result in results[name]]
            print(f"{name} {kind}: RssAnon growth {statistics.median(growth):.0f} MB "
                  f"[{min(growth):.0f}-{max(growth):.0f}], read seconds "
                  f"{spread([result[kind]['seconds'] for result in results[name]], 2)}")
    if "baseline" in checkouts:
        for kind in KINDS:
            ratios = round_ratios([r[kind]["seconds"] for r in results["baseline"]],
                                  [r[kind]["seconds"] for r in results["this"]], 1)
            print(f"read seconds baseline/this, {kind}: {spread(ratios)}")
        opens = [[r[kind]["open_seconds"] for r in results[name] for kind in KINDS] for name in ("baseline", "this")]
        print(f"seconds to open the dataset (every trial), baseline {spread(opens[0], 4)}, this {spread(opens[1], 4)}; "
              f"baseline/this {spread([old / new for old, new in zip(*opens)])}")
    print(command_line())


if __name__ == "__main__":
    main()
