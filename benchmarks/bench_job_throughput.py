"""Main-job throughput: ``jobs/train_tiny.py`` with the default executor (p2p, its
steps sent over a connection to each worker) vs ``--transport object_store`` and
vs ``--step-calls tasks`` (the same executor started by actor tasks), CPU.

Each run is the job as users run it, in its own process and its own local Ray
instance (``RAY_ADDRESS=local``): the tiny LLaMA on the standard-library corpus,
2 stages, m=4 (the job's defaults), ``--steps`` optimizer steps, no evaluation
(``--eval-every 0``, which only costs wall time outside the steps). Its figure is
``summary.json``'s ``tokens_per_second``: tokens of steps 2..N over their summed
step times (Ray start-up, actor start-up and the final checkpoint are outside it).

The contenders take turns, one run each per round, in A B C, C B A, ... order
(a run is ~30-60 s here, so load drifts within a round). Printed: per round the
ratios tokens/s(p2p) / tokens/s(object_store) and tokens/s(p2p) / tokens/s(p2p
tasks), and their medians with the min-max spread. Target: p2p/object_store >= 1.15.

    python benchmarks/bench_job_throughput.py --rounds 4 --steps 40
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

REPO = Path(__file__).resolve().parent.parent
# contender -> the job's flags: the default (p2p, direct calls), the per-op executor, and actor-task calls
CONTENDERS = {"p2p": [], "object_store": ["--transport", "object_store"], "p2p-tasks": ["--step-calls", "tasks"]}


def prepare_data(path: Path) -> None:
    """The job's corpus, prepared once before any timed run (the job would do it on its first run)."""
    if (path / "manifest.json").exists():
        return
    sys.path.insert(0, str(REPO))
    from raypipe.data import prepare
    from raypipe.models.llama import get_config

    prepare(path, seq_len=get_config("tiny").max_seq_len)


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """``--data``: the job's corpus, prepared (by :func:`prepare_data`) where the benchmarks share it."""
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "raypipe_bench_stdlib",
                        help="prepared dataset (prepared here first if missing)")


def run_job(args: argparse.Namespace, contender: str, out: Path) -> float:
    """One run of the job; its tokens/s."""
    command = [sys.executable, "jobs/train_tiny.py", "--steps", str(args.steps), "--eval-every", "0",
               *CONTENDERS[contender], "--data", str(args.data), "--out", str(out), "--no-progress",
               *args.job_args]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "RAY_ADDRESS": "local"}, capture_output=True,
                          text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())["tokens_per_second"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="runs per contender (default 4)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    add_data_argument(parser)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as failed")
    parser.add_argument("job_args", nargs="*", help="more flags for the job, after --")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(command_line())
    prepare_data(args.data)
    with tempfile.TemporaryDirectory(prefix="raypipe_job_bench_") as scratch:
        runs = {name: 0 for name in CONTENDERS}

        def contender(name: str):
            def run(count: int) -> list[float]:
                values = []
                for _ in range(count):
                    runs[name] += 1
                    values.append(run_job(args, name, Path(scratch) / f"{name}-{runs[name]}"))
                return values
            return run

        def on_round(index: int, results: dict) -> None:
            print(f"round {index + 1}: " + "  ".join(f"{n} {results[n][-1]:,.0f} tok/s" for n in CONTENDERS),
                  flush=True)

        results = run_rounds({name: contender(name) for name in CONTENDERS}, args.rounds, 1, 0, on_round,
                             reverse_odd_rounds=True)
    ratios = {other: round_ratios(results["p2p"], results[other], 1) for other in ("object_store", "p2p-tasks")}
    print()
    print_table(["round"] + [f"{n} tok/s" for n in CONTENDERS] + [f"p2p/{other}" for other in ratios],
                [[i + 1, *(f"{results[n][i]:,.0f}" for n in CONTENDERS), *(f"{r[i]:.3f}" for r in ratios.values())]
                 for i in range(args.rounds)])
    median = statistics.median(ratios["object_store"])
    print(f"\ntokens/s p2p/object_store: {spread(ratios['object_store'])}; target >= 1.15: "
          f"{'met' if median >= 1.15 else 'MISSED'}")
    print(f"tokens/s p2p/p2p-tasks: {spread(ratios['p2p-tasks'])}")
    print(command_line())


if __name__ == "__main__":
    main()
