"""Measured pipeline bubble vs GPipe theory, 2 stages, CPU, compute-bound.

For p=2 stages and m in {2, 4, 8, 16} micro-batches, one trainer each (same
model, same micro-batch size, so every op costs the same in every run). The
trainers live side by side and take turns round by round, so load from other
users of the shared CPU hits all alike. Each step's measured bubble per stage
is ``StepResult.bubble_fraction``: 1 - (the stage's F/B busy time) / (the step's
F/B window, first F start to last B end). Theory: (p-1)/(m+p-1).

The model is 8 blocks of Linear 512->2048, GELU, Linear 2048->512 (4 per
stage) on micro-batches of 512 rows: about 120 ms per forward and 240 ms per
backward on one thread. That keeps the fixed costs small next to an op: on a
2-core machine an actor task whose result is a tensor costs 2-4 ms between ops
on the same stage and a stage-to-stage hop 3-5 ms, and both count as idle time
(with 128-row micro-batches they alone add ~5 points at m=16).
Target: within 5 percentage points.

    python benchmarks/bench_bubble.py --rounds 3 --steps 2
"""
from __future__ import annotations

import argparse
import statistics

import ray
import torch
from torch import nn

import raypipe
from alternate import add_round_arguments, run_alternating

NUM_STAGES = 2
WIDTH, HIDDEN, NUM_BLOCKS = 512, 2048, 8


def build_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
                           for _ in range(NUM_BLOCKS)])


def theory(num_stages: int, num_micro_batches: int) -> float:
    """GPipe's bubble fraction (p-1)/(m+p-1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def make_trainer(num_micro_batches: int) -> raypipe.PipelineTrainer:
    config = raypipe.PipelineConfig(num_stages=NUM_STAGES, num_micro_batches=num_micro_batches,
                                    balance=[NUM_BLOCKS // NUM_STAGES] * NUM_STAGES)
    return raypipe.PipelineTrainer(build_model(), nn.MSELoss(),
                                   optimizer=lambda params: torch.optim.SGD(params, lr=1e-3), config=config)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=3, steps=2, warmup=1)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--micro-batch-size", type=int, default=512, help="rows per micro-batch (default 512)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    # One logical CPU per stage actor of every trainer; only one trainer computes at a time.
    ray.init(num_cpus=NUM_STAGES * len(args.micro_batches), include_dashboard=False, logging_level="WARNING")
    print(f"torch {torch.__version__}, ray {ray.__version__}; {NUM_BLOCKS} blocks {WIDTH}->{HIDDEN}->{WIDTH}, "
          f"p={NUM_STAGES}, micro-batch {args.micro_batch_size} rows, m in {args.micro_batches}")
    trainers = {m: make_trainer(m) for m in args.micro_batches}
    generator = torch.Generator().manual_seed(1)
    batches = {m: (torch.randn(m * args.micro_batch_size, WIDTH, generator=generator),
                   torch.randn(m * args.micro_batch_size, WIDTH, generator=generator)) for m in args.micro_batches}
    results = run_alternating(trainers, batches, args,
                              on_round=lambda index, _: print(f"round {index + 1} done"))
    report(results)


def report(results: dict[int, list[raypipe.StepResult]]) -> None:
    print(f"{'m':>3} {'theory':>7} {'stage 0':>8} {'stage 1':>8} {'max |diff|':>10} {'F ms':>6} {'B ms':>6} "
          f"{'step ms':>8}")
    worst = 0.0
    for m, res in results.items():
        measured = [statistics.median(r.bubble_fraction[s] for r in res) for s in range(NUM_STAGES)]
        expected = theory(NUM_STAGES, m)
        diff = max(abs(b - expected) for b in measured)
        worst = max(worst, diff)
        f_ms = 1e3 * statistics.median(e.end - e.start for r in res for e in r.timeline if e.op == "F")
        b_ms = 1e3 * statistics.median(e.end - e.start for r in res for e in r.timeline if e.op == "B")
        step_ms = 1e3 * statistics.median(r.step_time for r in res)
        print(f"{m:>3} {100 * expected:6.1f}% {100 * measured[0]:7.1f}% {100 * measured[1]:7.1f}% "
              f"{100 * diff:8.1f}pp {f_ms:6.1f} {b_ms:6.1f} {step_ms:8.1f}")
    print(f"largest deviation from theory: {100 * worst:.1f} percentage points "
          f"(target <= 5: {'met' if worst <= 0.05 else 'MISSED'})")


if __name__ == "__main__":
    main()
