"""What the benchmarks share: contenders take turns, round by round, so load from
other users of a shared machine hits them alike; figures are ratios taken
within a round (median over rounds, with the min-max spread), never absolute
times compared across rounds."""
from __future__ import annotations

import argparse
import shlex
import socket
import statistics
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # bench_vs_pippy's spawned PiPPy processes import this module without Ray
    import raypipe


def add_round_arguments(parser: argparse.ArgumentParser, rounds: int, steps: int, warmup: int) -> None:
    """``--rounds``, ``--steps`` and ``--warmup`` with this benchmark's defaults."""
    parser.add_argument("--rounds", type=int, default=rounds, help=f"alternating rounds (default {rounds})")
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per contender per round (default {steps})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps per contender first (default {warmup})")


def run_rounds(contenders: dict[Hashable, Callable[[int], list]], rounds: int, steps: int, warmup: int,
               on_round: Callable[[int, dict], None] | None = None, reverse_odd_rounds: bool = False
               ) -> dict[Hashable, list]:
    """The alternation itself: ``contender(n)`` runs ``n`` steps and returns one value
    per step. Each contender first runs ``warmup`` untimed steps, then every round
    gives each contender ``steps`` steps in turn (in reverse order on odd rounds if
    ``reverse_odd_rounds``: A B, B A, ..., for long turns over which load drifts).
    Returns every timed value per contender, round after round (round ``r`` is
    ``values[r * steps:(r + 1) * steps]``)."""
    results: dict[Hashable, list] = {key: [] for key in contenders}
    for run in contenders.values():
        if warmup:
            run(warmup)
    for round_index in range(rounds):
        order = list(contenders.items())
        if reverse_odd_rounds and round_index % 2:
            order.reverse()
        for key, run in order:
            results[key] += run(steps)
        if on_round is not None:
            on_round(round_index, results)
    return results


def print_round_ms(steps: int) -> Callable[[int, dict], None]:
    """An ``on_round`` for :func:`run_rounds` over step times in seconds: prints each
    contender's median step of the round just run, in ms."""
    def on_round(index: int, results: dict) -> None:
        last = {key: 1e3 * statistics.median(values[-steps:]) for key, values in results.items()}
        print(f"round {index + 1:2d}: " + "  ".join(f"{'/'.join(key)} {ms:.0f}" for key, ms in last.items())
              + " ms", flush=True)

    return on_round


def run_alternating(trainers: dict[Hashable, raypipe.PipelineTrainer], batches: dict[Hashable, tuple],
                    args: argparse.Namespace,
                    on_round: Callable[[int, dict], None] | None = None) -> dict[Hashable, list]:
    """Warm every trainer up, then give each ``args.steps`` steps per round; shut
    the trainers and Ray down at the end. Returns every timed StepResult per trainer."""
    import ray

    def stepper(key: Hashable) -> Callable[[int], list]:
        return lambda count: [trainers[key].step(*batches[key]) for _ in range(count)]

    try:
        return run_rounds({key: stepper(key) for key in trainers}, args.rounds, args.steps, args.warmup, on_round)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
        ray.shutdown()


# -- per-round figures ------------------------------------------------------------
def rounds_of(values: Sequence[Any], steps: int) -> list[list[Any]]:
    """A contender's timed values, one list per round."""
    return [list(values[start:start + steps]) for start in range(0, len(values), steps)]


def round_medians(values: Sequence[float], steps: int) -> list[float]:
    """Per round, the median of that round's values."""
    return [statistics.median(chunk) for chunk in rounds_of(values, steps)]


def round_ratios(numerator: Sequence[float], denominator: Sequence[float], steps: int) -> list[float]:
    """Per round, median(numerator's steps) / median(denominator's steps): the two ran
    back to back in that round, under the same load."""
    return [a / b for a, b in zip(round_medians(numerator, steps), round_medians(denominator, steps))]


def spread(values: Sequence[float], digits: int = 3) -> str:
    """``median [min-max] (n rounds)`` of per-round figures."""
    return (f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}] "
            f"(n={len(values)})")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (a process group's rendezvous for the contenders' processes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command_line() -> str:
    """The command that ran this benchmark, to print beside its table."""
    return "python " + shlex.join(sys.argv)


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A Markdown table (pastes into RESULTS.md as it is)."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
