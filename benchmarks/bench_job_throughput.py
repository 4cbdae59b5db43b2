"""Main-job throughput: ``jobs/train_tiny.py`` with the default executor (p2p, its
steps sent over a connection to each worker) vs ``--transport object_store`` and
vs ``--step-calls tasks`` (the same executor started by actor tasks), CPU.

Each run is the job as users run it, in its own process and its own local Ray
instance (``RAY_ADDRESS=local``): the tiny LLaMA on the standard-library corpus,
2 stages, 8 micro-batches of 2 sequences (the job's defaults), ``--steps`` optimizer steps, no evaluation
(``--eval-every 0``, which only costs wall time outside the steps). Its figure is
``summary.json``'s ``tokens_per_second``: tokens of steps 2..N over their summed
step times (Ray start-up, actor start-up and the final checkpoint are outside it).

The contenders take turns, one run each per round, in A B C, C B A, ... order
(a run is ~30-60 s here, so load drifts within a round). Printed: per round the
ratios tokens/s(p2p) / tokens/s(object_store) and tokens/s(p2p) / tokens/s(p2p
tasks), and their medians with the min-max spread. Target: p2p/object_store >= 1.15.

``--shapes 4x4 8x2`` runs the contenders at each step shape (micro-batches x
sequences per micro-batch, the same tokens per step) instead of the job's default,
and adds p2p's tokens/s at each later shape over the first's.

``--schedules 1f1b zbv interleaved_1f1b`` runs the default executor under each schedule instead
(interleaved_1f1b and zbv with ``--virtual-stages 2``: the tiny LLaMA's 6 layers as 4 virtual
stages) and prints each one's tokens/s over the first's (issue 42's main-job figure).

    python benchmarks/bench_job_throughput.py --rounds 4 --steps 40
    python benchmarks/bench_job_throughput.py --rounds 8 --steps 40 --contenders p2p object_store --shapes 4x4 8x2
    python benchmarks/bench_job_throughput.py --rounds 3 --steps 40 --schedules 1f1b zbv interleaved_1f1b
    python benchmarks/bench_job_throughput.py --rounds 4 --steps 40 --contenders p2p p2p-no-snapshots
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
from raypipe.core.schedule import SCHEDULES, SINGLE_CHUNK_SCHEDULES

REPO = Path(__file__).resolve().parent.parent
# contender -> the job's flags: the default (p2p, direct calls), the per-op executor, actor-task calls, and the
# default without its per-step snapshot (what the snapshot costs the main job); each is compared with p2p
CONTENDERS = {"p2p": [], "object_store": ["--transport", "object_store"], "p2p-tasks": ["--step-calls", "tasks"],
              "p2p-no-snapshots": ["--snapshot-every", "0"]}


def contenders(chosen: list[str], shapes: list[str], schedules: list[str] = ()) -> dict[str, list[str]]:
    """Contender name -> the job's flags: each chosen contender at each shape ("MxB": M
    micro-batches of B sequences), or at the job's default shape when none is given; or with
    ``schedules``, the default executor under each schedule."""
    if schedules:
        return {f"p2p {schedule}": ["--schedule", schedule, *(["--virtual-stages", "2"]
                                                             if schedule not in SINGLE_CHUNK_SCHEDULES else [])]
                for schedule in schedules}
    if not shapes:
        return {name: CONTENDERS[name] for name in chosen}
    flags = {}
    for shape in shapes:
        micro_batches, size = shape.split("x")
        for name in chosen:
            flags[f"{name} {shape}"] = [*CONTENDERS[name], "--micro-batches", micro_batches,
                                        "--micro-batch-size", size]
    return flags


def prepared_data(path: str) -> Path:
    """The job's corpus at ``path``, prepared there first if missing: once, before any timed run
    (the job would do it on its first run)."""
    corpus = Path(path)
    if not (corpus / "manifest.json").exists():
        sys.path.insert(0, str(REPO))
        from raypipe.data import prepare
        from raypipe.models.llama import get_config

        prepare(corpus, seq_len=get_config("tiny").max_seq_len)
    return corpus


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """``--data``: the job's corpus where the benchmarks share it, prepared as the command line is
    parsed (argparse converts a string default too)."""
    parser.add_argument("--data", type=prepared_data, default=str(Path(tempfile.gettempdir()) / "raypipe_bench_stdlib"),
                        help="prepared dataset (prepared here first if missing)")


def run_job(args: argparse.Namespace, flags: list[str], out: Path) -> float:
    """One run of the job with ``flags``; its tokens/s."""
    command = [sys.executable, "jobs/train_tiny.py", "--steps", str(args.steps), "--eval-every", "0",
               *flags, "--data", str(args.data), "--out", str(out), "--no-progress",
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
    parser.add_argument("--contenders", "--executors", dest="contenders", nargs="+", choices=list(CONTENDERS),
                        default=["p2p", "object_store", "p2p-tasks"],
                        help="the executors, and p2p-no-snapshots: the default without its per-step snapshot "
                             "(default: p2p object_store p2p-tasks; p2p is needed)")
    parser.add_argument("--shapes", nargs="*", default=[], metavar="MxB",
                        help="step shapes: M micro-batches of B sequences (default: the job's)")
    parser.add_argument("--schedules", nargs="*", default=[], choices=SCHEDULES,
                        help="the default executor under each schedule (2 chunks a worker for the chunked ones), "
                             "each one's tokens/s over the first's")
    parser.add_argument("job_args", nargs="*", help="more flags for the job, after --")
    args = parser.parse_args()
    if "p2p" not in args.contenders:
        parser.error("--contenders needs p2p: every figure is a ratio to it")
    return args


def main() -> None:
    args = parse_args()
    print(command_line())
    flags = contenders(args.contenders, args.shapes, args.schedules)
    with tempfile.TemporaryDirectory(prefix="raypipe_job_bench_") as scratch:
        runs = {name: 0 for name in flags}

        def contender(name: str):
            def run(count: int) -> list[float]:
                values = []
                for _ in range(count):
                    runs[name] += 1
                    out = Path(scratch) / f"{name.replace(' ', '-')}-{runs[name]}"
                    values.append(run_job(args, flags[name], out))
                return values
            return run

        def on_round(index: int, results: dict) -> None:
            print(f"round {index + 1}: " + "  ".join(f"{n} {results[n][-1]:,.0f} tok/s" for n in flags), flush=True)

        results = run_rounds({name: contender(name) for name in flags}, args.rounds, 1, 0, on_round,
                             reverse_odd_rounds=True)
    ratios = (figures(results, args.shapes or [""]) if not args.schedules else
              {f"{name}/{names[0]}": round_ratios(results[name], results[names[0]], 1)
               for names in [list(flags)] for name in names[1:]})
    print()
    print_table(["round"] + [f"{n} tok/s" for n in flags] + list(ratios),
                [[i + 1, *(f"{results[n][i]:,.0f}" for n in flags), *(f"{r[i]:.3f}" for r in ratios.values())]
                 for i in range(args.rounds)])
    print()
    for name, values in ratios.items():
        target = ""
        if name.startswith("p2p") and "/object_store" in name:
            target = f"; target >= 1.15: {'met' if statistics.median(values) >= 1.15 else 'MISSED'}"
        print(f"tokens/s {name}: {spread(values)}{target}")
    print(command_line())


def figures(results: dict[str, list[float]], shapes: list[str]) -> dict[str, list[float]]:
    """Per-round ratios: at each shape, p2p over each other executor; at each later
    shape, p2p over p2p at the first."""
    def name(executor: str, shape: str) -> str:
        return f"{executor} {shape}".strip()

    ratios = {}
    for shape in shapes:
        p2p = results[name("p2p", shape)]
        for other in (contender for contender in CONTENDERS if contender != "p2p"):
            if name(other, shape) in results:
                ratios[f"{name('p2p', shape)}/{name(other, shape)}"] = round_ratios(p2p, results[name(other, shape)], 1)
    for shape in shapes[1:]:
        ratios[f"{name('p2p', shape)}/{name('p2p', shapes[0])}"] = round_ratios(
            results[name("p2p", shape)], results[name("p2p", shapes[0])], 1)
    return ratios


if __name__ == "__main__":
    main()
