"""Main-job throughput: ``jobs/train_tiny.py`` with the default executor (p2p) vs
``--transport object_store``, CPU.

Each run is the job as users run it, in its own process and its own local Ray
instance (``RAY_ADDRESS=local``): the tiny LLaMA on the standard-library corpus,
2 stages, m=4 (the job's defaults), ``--steps`` optimizer steps, no evaluation
(``--eval-every 0``, which only costs wall time outside the steps). Its figure is
``summary.json``'s ``tokens_per_second``: tokens of steps 2..N over their summed
step times (Ray start-up, actor start-up and the final checkpoint are outside it).

The two transports take turns, one run each per round, in A B, B A, ... order
(a run is ~30-60 s here, so load drifts within a round). Printed: per round the
ratio tokens/s(p2p) / tokens/s(object_store), and their median with the min-max
spread. Target: >= 1.15.

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
TRANSPORTS = ("p2p", "object_store")


def prepare_data(path: Path) -> None:
    """The job's corpus, prepared once before any timed run (the job would do it on its first run)."""
    if (path / "manifest.json").exists():
        return
    sys.path.insert(0, str(REPO))
    from raypipe.data import prepare
    from raypipe.models.llama import get_config

    prepare(path, seq_len=get_config("tiny").max_seq_len)


def run_job(args: argparse.Namespace, transport: str, out: Path) -> float:
    """One run of the job; its tokens/s."""
    command = [sys.executable, "jobs/train_tiny.py", "--steps", str(args.steps), "--eval-every", "0",
               "--transport", transport, "--data", str(args.data), "--out", str(out), "--no-progress",
               *args.job_args]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "RAY_ADDRESS": "local"}, capture_output=True,
                          text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())["tokens_per_second"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="runs per transport (default 4)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "raypipe_bench_stdlib",
                        help="prepared dataset (prepared here first if missing)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as failed")
    parser.add_argument("job_args", nargs="*", help="more flags for the job, after --")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(command_line())
    prepare_data(args.data)
    with tempfile.TemporaryDirectory(prefix="raypipe_job_bench_") as scratch:
        runs = {transport: 0 for transport in TRANSPORTS}

        def contender(transport: str):
            def run(count: int) -> list[float]:
                values = []
                for _ in range(count):
                    runs[transport] += 1
                    values.append(run_job(args, transport, Path(scratch) / f"{transport}-{runs[transport]}"))
                return values
            return run

        def on_round(index: int, results: dict) -> None:
            print(f"round {index + 1}: " + "  ".join(f"{t} {results[t][-1]:,.0f} tok/s" for t in TRANSPORTS)
                  + f"  ratio {results['p2p'][-1] / results['object_store'][-1]:.3f}", flush=True)

        results = run_rounds({t: contender(t) for t in TRANSPORTS}, args.rounds, 1, 0, on_round,
                             reverse_odd_rounds=True)
    ratios = round_ratios(results["p2p"], results["object_store"], 1)
    print()
    print_table(["round"] + [f"{t} tok/s" for t in TRANSPORTS] + ["p2p/object_store"],
                [[i + 1, f"{results['p2p'][i]:,.0f}", f"{results['object_store'][i]:,.0f}", f"{r:.3f}"]
                 for i, r in enumerate(ratios)])
    median = statistics.median(ratios)
    print(f"\ntokens/s p2p/object_store: {spread(ratios)}; target >= 1.15: {'met' if median >= 1.15 else 'MISSED'}")
    print(command_line())


if __name__ == "__main__":
    main()
