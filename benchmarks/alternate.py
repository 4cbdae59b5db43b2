"""What the benchmarks share: contenders take turns, round by round, so load from
other users of a shared machine hits them alike."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # bench_vs_pippy's spawned PiPPy processes import this module without Ray
    import raypipe


def add_round_arguments(parser: argparse.ArgumentParser, rounds: int, steps: int, warmup: int) -> None:
    """``--rounds``, ``--steps`` and ``--warmup`` with this benchmark's defaults."""
    parser.add_argument("--rounds", type=int, default=rounds, help=f"alternating rounds (default {rounds})")
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per contender per round (default {steps})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps per contender first (default {warmup})")


def run_alternating(trainers: dict[Hashable, raypipe.PipelineTrainer], batches: dict[Hashable, tuple],
                    args: argparse.Namespace,
                    on_round: Callable[[int, dict], None] | None = None) -> dict[Hashable, list]:
    """Warm every trainer up, then give each ``args.steps`` steps per round; shut
    the trainers and Ray down at the end. Returns every timed StepResult per trainer."""
    import ray

    results: dict[Hashable, list] = {key: [] for key in trainers}
    try:
        for key, trainer in trainers.items():
            for _ in range(args.warmup):
                trainer.step(*batches[key])
        for round_index in range(args.rounds):
            for key, trainer in trainers.items():
                results[key] += [trainer.step(*batches[key]) for _ in range(args.steps)]
            if on_round is not None:
                on_round(round_index, results)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
        ray.shutdown()
    return results
