"""Stages balanced by time against stages balanced by parameters, measured side by side
(issue 43's balancer target), on timed layers shaped like a LLaMA.

A LLaMA's layers weigh differently by parameters and by time: the embedding holds
``vocab x dim`` parameters and costs a lookup; the output head plus the cross-entropy
holds as many and costs more than a block. At LLaMA-3 8B's shapes (vocab 128,256,
dim 4,096, a block 218M parameters, the head's matmul 2 x 525M flops a token against a
block's ~2 x 218M plus attention) the head computes about 2.4 blocks' worth. The model
here: ``--blocks`` timed blocks (F = I = W = ``--block-ms``), an embedding of F = W =
0.2 ms and no input gradient, and a head of 2.4 blocks' time; the parameter balance
sees the 8B's parameter counts (stated on each layer's spec: the layers themselves are
8 features wide), the time balance the layers' :class:`raypipe.LayerCost` (their
times). Every timed part sleeps without using a core (:mod:`raypipe.testing.timed_layers`),
so p stage processes behave as p devices on 2 cores.

The two trainers (``balance="parameters"`` and ``balance="time"``, same weights, same
batch) take turns, round by round; per round the ratio of their median steps. Beside
it, the slowest stage's compute per micro-batch under each balance (the balancer's
objective) and ``simulate_timed``'s step for the same ops and times (no overhead).

    python benchmarks/bench_balance.py --rounds 5 --steps 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import raypipe
from alternate import add_round_arguments, command_line, print_table, round_medians, round_ratios, run_rounds, spread
from raypipe.core.lowering import lower
from raypipe.core.partition import stage_layer_ranges
from raypipe.core.schedule import PLACEMENT, make_schedule
from raypipe.core.timed_simulation import simulate_timed
from raypipe.planning.balance import resolve_balance
from raypipe.testing import TimedLayer

EMBEDDING_PARAMETERS, BLOCK_PARAMETERS = 525_336_576, 218_112_000  # LLaMA-3 8B: 128,256 x 4,096; one block
HEAD_BLOCKS = 2.4  # the head + cross-entropy's time in blocks, at the 8B's shapes (see the docstring)
EMBEDDING_MS = 0.2


class StatedSpec(raypipe.LayerSpec):
    """A timed layer's recipe whose parameter count is stated (a LLaMA layer's), not its own."""

    def __init__(self, parameters: int, *args, **kwargs) -> None:
        super().__init__(TimedLayer, *args, **kwargs)
        self.parameters = parameters

    def num_parameters(self) -> int:
        return self.parameters


def layer_times_ms(args: argparse.Namespace) -> list[tuple[float, float, float]]:
    """(F, I, W) of every layer, in ms: the embedding, the blocks, the head."""
    head = HEAD_BLOCKS * args.block_ms
    return ([(EMBEDDING_MS, 0.0, EMBEDDING_MS)] + [(args.block_ms,) * 3] * args.blocks + [(head, head, head)])


def build_layers(args: argparse.Namespace) -> list[StatedSpec]:
    counts = [EMBEDDING_PARAMETERS] + [BLOCK_PARAMETERS] * args.blocks + [EMBEDDING_PARAMETERS]
    return [StatedSpec(count, f / 1e3, i / 1e3, w / 1e3, width=args.width, cost=raypipe.LayerCost(f, i, w))
            for count, (f, i, w) in zip(counts, layer_times_ms(args))]


def predicted(args: argparse.Namespace, balance: list[int]) -> tuple[float, float]:
    """The slowest stage's F + B per micro-batch, and simulate_timed's 1F1B step, in ms."""
    times = layer_times_ms(args)
    stage_times = [[sum(times[i][k] for i in layers) for k in range(3)] for layers in stage_layer_ranges(balance)]
    lowered = lower(make_schedule(args.schedule, len(balance), args.micro_batches), PLACEMENT[args.schedule])

    def op_ms(stage: int, op) -> float:
        forward, input_grad, weight_grad = stage_times[stage]
        return {"F": forward, "B": input_grad + weight_grad, "I": input_grad, "W": weight_grad}.get(op.kind, 0.0)

    step = simulate_timed(lowered, op_ms).step_s
    return max(sum(parts) for parts in stage_times), step


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=5, steps=3, warmup=2)
    parser.add_argument("--stages", "-p", type=int, default=4, help="pipeline stages (default 4)")
    parser.add_argument("--micro-batches", "-m", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--blocks", type=int, default=8, help="timed blocks between embedding and head (default 8)")
    parser.add_argument("--block-ms", type=float, default=4.0, help="a block's F, I and W each (default 4)")
    parser.add_argument("--schedule", default="1f1b", help="(default 1f1b)")
    parser.add_argument("--width", type=int, default=8, help="features per layer (default 8)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    import ray

    ray.init(address="local", num_cpus=2 * args.stages, include_dashboard=False, logging_level="WARNING")
    layers = build_layers(args)
    rows = args.micro_batches * 4
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(rows, args.width, generator=generator), torch.randn(rows, args.width, generator=generator))
    trainers, balances = {}, {}
    try:
        for mode in ("parameters", "time"):
            config = raypipe.PipelineConfig(num_stages=args.stages, num_micro_batches=args.micro_batches,
                                            balance=mode, schedule=args.schedule)
            balances[mode] = resolve_balance(config, layers)
            trainers[mode] = raypipe.PipelineTrainer(layers, nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=1e-3),
                                                     config=config)
            assert list(trainers[mode].balance) == balances[mode], (trainers[mode].balance, balances[mode])

        def stepper(mode: str):
            def run(count: int) -> list[float]:
                times = []
                for _ in range(count):
                    start = time.perf_counter()
                    trainers[mode].step(*batch)
                    times.append(time.perf_counter() - start)
                return times
            return run

        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
              f"p={args.stages}, m={args.micro_batches}, {args.schedule}; balances {balances}", flush=True)
        times = run_rounds({mode: stepper(mode) for mode in trainers}, args.rounds, args.steps, args.warmup)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
        ray.shutdown()
    table = []
    for mode in ("parameters", "time"):
        slowest, simulated = predicted(args, balances[mode])
        table.append([f"balance={mode!r}", str(balances[mode]), f"{slowest:.1f}", f"{simulated:.0f}",
                      spread([1e3 * t for t in round_medians(times[mode], args.steps)], digits=0)])
    print()
    print_table(["balance", "layers per stage", "slowest stage's F+B per micro-batch, ms",
                 "simulated step (no overhead), ms", "measured step ms, median [min-max] of round medians"], table)
    ratio = round_ratios(times["time"], times["parameters"], args.steps)
    ideal = predicted(args, balances["time"])[1] / predicted(args, balances["parameters"])[1]
    print(f"\ntime / parameters, per round: {spread(ratio)}; simulated {ideal:.3f}; "
          f"median step {statistics.median(times['time']) * 1e3:.0f} vs "
          f"{statistics.median(times['parameters']) * 1e3:.0f} ms")
    print(command_line())


if __name__ == "__main__":
    main()
