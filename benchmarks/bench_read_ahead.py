"""A reading stage's steps with the next step's data read in the background
(:class:`raypipe.stage.data_reader.StageData`, the default) vs read when the step
asks for it, CPU.

The stage is the main job's data and model in one process: the tiny LLaMA as
a one-stage pipeline (it reads inputs and targets), 1 torch thread (a stage
actor's ``cpus_per_stage``), micro-batches of 4 x 256 tokens, 4 per step, on the
standard-library corpus (prepared first if missing). Every run opens the dataset
afresh, so its shards load during the run's first steps, as in a new job (29
shards of 4096 rows; each first load reads, checksums and decodes a shard). A
step is the micro-batches' data reads, forwards and backwards (no optimizer:
the compute stays the same from run to run).

Per contender and round, one run of ``--steps`` steps; step 0 is left out (no
step comes before it to read it ahead). Printed per round: the summed step
time and the time the step waited for data, per contender, and the ratio
read-ahead / on-demand of the summed step times; then their median and spread.
The other core of a 2-core machine is free here (in the job the other stage
runs on it), so this is the bound of what read-ahead can save on this machine.

    python benchmarks/bench_read_ahead.py --rounds 8 --steps 10
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from alternate import add_round_arguments, command_line, print_table, run_rounds, spread
from bench_job_throughput import add_data_argument
from raypipe.data import TokenDataset
from raypipe.models.layers import build_layer
from raypipe.models.llama import llama_layers, llama_loss
from raypipe.stage.data_reader import StageData

CONTENDERS = {"read-ahead": True, "on-demand": False}
MICRO_BATCHES, MICRO_BATCH_SIZE = 4, 4


def run_steps(model: torch.nn.Module, path: Path, read_ahead: bool, steps: int) -> list[tuple[float, float]]:
    """One fresh run: (step seconds, seconds waiting for data) of steps 1..steps-1."""
    data = StageData(None, range(MICRO_BATCHES), reads_inputs=True, reads_targets=True, read_ahead=read_ahead)
    data.attach(TokenDataset(path, micro_batch_size=MICRO_BATCH_SIZE, num_micro_batches=MICRO_BATCHES))
    timings = []
    for step in range(steps):
        started, waited = time.perf_counter(), 0.0
        for micro_batch in range(MICRO_BATCHES):
            asked = time.perf_counter()
            inputs = data.inputs(step, micro_batch, "train")
            targets, weight = data.targets_and_weight(step, micro_batch, "train")
            waited += time.perf_counter() - asked
            (llama_loss(model(inputs), targets) * weight).backward()
        model.zero_grad(set_to_none=True)
        timings.append((time.perf_counter() - started, waited))
    return timings[1:]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=8, steps=10, warmup=1)  # --warmup counts whole untimed runs here
    add_data_argument(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(command_line())
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*(build_layer(layer, index, seed=0)
                                  for index, layer in enumerate(llama_layers("tiny"))))
    contenders = {name: (lambda runs, flag=flag: [run_steps(model, args.data, flag, args.steps)
                                                   for _ in range(runs)])
                  for name, flag in CONTENDERS.items()}
    results = run_rounds(contenders, args.rounds, 1, args.warmup, reverse_odd_rounds=True)
    step_sums = {name: [sum(step for step, _ in run) for run in runs] for name, runs in results.items()}
    wait_sums = {name: [sum(wait for _, wait in run) for run in runs] for name, runs in results.items()}
    ratios = [ahead / on_demand for ahead, on_demand in zip(step_sums["read-ahead"], step_sums["on-demand"])]
    print()
    print_table(["round"] + [f"{name} steps s (data wait s)" for name in CONTENDERS] + ["read-ahead/on-demand"],
                [[index + 1, *(f"{step_sums[name][index]:.2f} ({wait_sums[name][index]:.3f})" for name in CONTENDERS),
                  f"{ratios[index]:.3f}"] for index in range(args.rounds)])
    for name in CONTENDERS:
        print(f"{name}: data wait per run, median {statistics.median(wait_sums[name]) * 1000:.0f} ms over "
              f"{args.steps - 1} steps")
    print(f"summed step time read-ahead/on-demand: {spread(ratios)}")
    print(command_line())


if __name__ == "__main__":
    main()
