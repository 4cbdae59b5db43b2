"""GPipe vs 1F1B: activations held for backward per stage, and step time, CPU.

For each number of stages p and micro-batches m, two trainers on the same model
and the same micro-batches (one with ``schedule="gpipe"``, one with
``schedule="1f1b"``) live side by side and take turns round by round, so load
from other users of the shared CPU hits both alike. Printed per stage:

* the peak bytes held for backward in a step (``StepResult.stages[s].held_for_backward_bytes``),
  divided by what the same stage holds for ONE micro-batch (measured with a
  GPipe trainer at m=1 on micro-batches of the same size). GPipe keeps every
  micro-batch until its backward, so it should hold m of them; 1F1B starts a
  stage's backwards after ``p - stage`` forwards, so it should hold at most
  ``min(p - stage, m)``;
* the step-time ratio 1F1B/GPipe: per round the median of each trainer's steps,
  their ratio, then the median over rounds with its min-max spread (the bubble
  is the same, so theory says 1.0).

The model is an ``nn.Sequential`` of blocks Linear(width->hidden), GELU,
Linear(hidden->width), split evenly over the stages, with MSE loss, SGD and the
default executor (``transport="p2p"``). Every stage is an actor with one thread;
Ray gets ``2 p`` logical CPUs (two trainers of p stages) however many cores the
machine has, so p=4 also runs on 2 cores (the stages then share them).

    python benchmarks/bench_schedules.py --rounds 8 --steps 2
    python benchmarks/bench_schedules.py --stages 2 --micro-batches 4 8 --rounds 8   # shrink
"""
from __future__ import annotations

import argparse
import statistics

import ray
import torch
from torch import nn

import raypipe
from alternate import add_round_arguments, command_line, print_table, round_medians, round_ratios, run_rounds, spread

SCHEDULES = ("gpipe", "1f1b")


def build_model(args: argparse.Namespace, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.hidden), nn.GELU(),
                                         nn.Linear(args.hidden, args.width)) for _ in range(args.blocks)])


def make_trainer(args: argparse.Namespace, stages: int, micro_batches: int, schedule: str) -> raypipe.PipelineTrainer:
    config = raypipe.PipelineConfig(num_stages=stages, num_micro_batches=micro_batches, schedule=schedule,
                                    balance=[args.blocks // stages] * stages, transport=args.transport)
    return raypipe.PipelineTrainer(build_model(args), nn.MSELoss(),
                                   optimizer=lambda params: torch.optim.SGD(params, lr=1e-3), config=config)


def make_batch(args: argparse.Namespace, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    rows = micro_batches * args.micro_batch_size
    return torch.randn(rows, args.width, generator=generator), torch.randn(rows, args.width, generator=generator)


def held_bytes(result: raypipe.StepResult) -> list[int]:
    return [stage.held_for_backward_bytes for stage in result.stages]


def one_micro_batch(args: argparse.Namespace, stages: int) -> list[int]:
    """Per stage, the bytes held for backward for one micro-batch (GPipe, m=1, same micro-batch size)."""
    trainer = make_trainer(args, stages, 1, "gpipe")
    try:
        batch = make_batch(args, 1)
        trainer.step(*batch)
        return held_bytes(trainer.step(*batch))
    finally:
        trainer.shutdown()


def measure(args: argparse.Namespace, stages: int, micro_batches: int) -> dict[str, list[raypipe.StepResult]]:
    """GPipe and 1F1B at (p, m), alternating round by round."""
    trainers = {name: make_trainer(args, stages, micro_batches, name) for name in SCHEDULES}
    batch = make_batch(args, micro_batches)
    try:
        return run_rounds({name: (lambda count, t=trainer: [t.step(*batch) for _ in range(count)])
                           for name, trainer in trainers.items()}, args.rounds, args.steps, args.warmup)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=8, steps=2, warmup=1)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="p values (default 2 4)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16], help="m values (default 4 8 16)")
    parser.add_argument("--micro-batch-size", type=int, default=32, help="rows per micro-batch (default 32)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8, help="MLP blocks, split evenly over the stages (default 8)")
    parser.add_argument("--transport", default="p2p", help="PipelineConfig.transport (default p2p)")
    args = parser.parse_args()
    for stages in args.stages:
        if args.blocks % stages:
            parser.error(f"--blocks {args.blocks} must be divisible by every --stages value ({stages})")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    print(f"torch {torch.__version__}, ray {ray.__version__}; {args.blocks} blocks {args.width}->{args.hidden}->"
          f"{args.width}, micro-batch {args.micro_batch_size} rows, SGD, transport {args.transport}; "
          f"{args.rounds} rounds x {args.steps} steps per schedule")
    rows, ok = [], True
    for stages in args.stages:
        # two trainers of ``stages`` one-CPU actors at a time: logical CPUs, whatever the cores
        ray.init(num_cpus=2 * stages, include_dashboard=False, logging_level="WARNING")
        try:
            unit = one_micro_batch(args, stages)
            for micro_batches in args.micro_batches:
                results = measure(args, stages, micro_batches)
                ratios = round_ratios([r.step_time for r in results["1f1b"]],
                                      [r.step_time for r in results["gpipe"]], args.steps)
                medians = {name: 1e3 * statistics.median(round_medians([r.step_time for r in res], args.steps))
                           for name, res in results.items()}
                for stage in range(stages):
                    # peaks are per step and every step has the same shapes: take the largest seen
                    held = {name: max(held_bytes(r)[stage] for r in res) for name, res in results.items()}
                    in_units = {name: held[name] / unit[stage] for name in SCHEDULES}
                    bound = min(stages - stage, micro_batches)
                    ok &= in_units["1f1b"] <= bound + 0.05 and abs(in_units["gpipe"] - micro_batches) <= 0.05 * micro_batches
                    rows.append([stages, micro_batches, stage, f"{unit[stage] / 2**10:.0f}",
                                 f"{held['gpipe'] / 2**10:.0f}", f"{in_units['gpipe']:.2f}", micro_batches,
                                 f"{held['1f1b'] / 2**10:.0f}", f"{in_units['1f1b']:.2f}", bound,
                                 f"{medians['gpipe']:.0f} / {medians['1f1b']:.0f}" if stage == 0 else "",
                                 spread(ratios) if stage == 0 else ""])
                print(f"p={stages} m={micro_batches}: 1F1B/GPipe step time {spread(ratios)}", flush=True)
        finally:
            ray.shutdown()
    print()
    print_table(["p", "m", "stage", "1 mb KiB", "GPipe KiB", "GPipe /mb", "m", "1F1B KiB", "1F1B /mb",
                 "min(p-s,m)", "step ms GPipe / 1F1B (median of round medians)",
                 "1F1B/GPipe step (median [min-max])"], rows)
    print(f"\n1F1B holds <= min(p - stage, m) micro-batches and GPipe holds m on every stage: "
          f"{'yes' if ok else 'NO'}")
    print(command_line())


if __name__ == "__main__":
    main()
