"""Fault tolerance on CPU: what in-memory snapshots cost per step, and how long a
killed worker takes to heal.

Step time with ``snapshot_every=1`` (every worker copies its state to host memory
after every step, as it first waits in the next one, and ships the copy) against
``snapshot_every=0`` (no snapshots: a failure would be fatal), the two trainers of
each model taking turns round by round (A B, B A, ...) on one local Ray instance, for:

* ``llama``: the tiny LLaMA on 2 stages (p2p executor, AdamW, clip 1.0), m=4;
* ``mlp``: an MLP of 6 blocks 384->1536->384 on 2 stages, m=6 micro-batches of 64
  rows, SGD, MSE loss (the weights are large against the compute: ~28 MB of
  weights for a ~190 ms step, where a snapshot's copy shows most).

Printed per model: the per-round step-time ratio of the two (median and min-max).
Then, for ``--kills`` trials on the tiny LLaMA, the seconds from SIGKILL of a
seeded-random worker, at a seeded-random moment of a step, to that step's
completion (detection, replacement of the worker, restore of every worker, redo
of the step).

With ``--spares`` only the SIGKILL trials run, ``--kills`` each on two tiny-LLaMA
trainers alive side by side, taking turns kill by kill (A B, B A, ...): one with a
warm spare (``spare_workers=1``: the spare takes the killed worker's place; each
kill waits for the new spare to be up first) and one without (a process started
from the worker's spec). Printed: each one's seconds from SIGKILL to the step done.

    python benchmarks/bench_recovery.py --rounds 8 --steps 4 --kills 5
    python benchmarks/bench_recovery.py --models mlp llama --rounds 10 --steps 4 --kills 0
    python benchmarks/bench_recovery.py --spares --kills 8
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import threading
import time

import ray
import torch
from torch import nn

import raypipe
from alternate import add_round_arguments, command_line, print_table, round_ratios, run_rounds, spread
from bench_data_parallel import adamw, tokens  # the same optimizer and token batches
from raypipe.models.llama import get_config, llama_layers, llama_loss

MODEL = "tiny"
MLP_BLOCKS, MLP_WIDTH, MLP_HIDDEN, MLP_MICRO_BATCHES, MLP_ROWS = 6, 384, 1536, 6, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=8, steps=4, warmup=2)
    parser.add_argument("--models", nargs="+", choices=("llama", "mlp"), default=["llama", "mlp"],
                        help="whose snapshot cost to measure (default: llama mlp)")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILL trials on the tiny LLaMA (default 5)")
    parser.add_argument("--spares", action="store_true",
                        help="only the SIGKILL trials, with a warm spare (spare_workers=1) and without, in turns")
    parser.add_argument("--micro-batches", type=int, default=4, help="the tiny LLaMA's (default 4)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="the tiny LLaMA's (default 2)")
    return parser.parse_args()


def trainer(config, snapshot_every: int, spare_workers: int = 0) -> raypipe.PipelineTrainer:
    return raypipe.PipelineTrainer(llama_layers(config), llama_loss, adamw, raypipe.PipelineConfig(
        num_stages=2, num_micro_batches=4, clip_grad_norm=1.0, snapshot_every=snapshot_every, max_failures=None,
        spare_workers=spare_workers))


def mlp_trainer(snapshot_every: int) -> raypipe.PipelineTrainer:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(MLP_WIDTH, MLP_HIDDEN), nn.GELU(), nn.Linear(MLP_HIDDEN, MLP_WIDTH))
              for _ in range(MLP_BLOCKS)]
    return raypipe.PipelineTrainer(nn.Sequential(*blocks), nn.MSELoss(),
                                   lambda params: torch.optim.SGD(params, lr=1e-3), raypipe.PipelineConfig(
        num_stages=2, num_micro_batches=MLP_MICRO_BATCHES, balance=[MLP_BLOCKS // 2] * 2,
        snapshot_every=snapshot_every))


def mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    rows = MLP_MICRO_BATCHES * MLP_ROWS
    return torch.randn(rows, MLP_WIDTH, generator=generator), torch.randn(rows, MLP_WIDTH, generator=generator)


def snapshot_cost(build, batch: tuple, args: argparse.Namespace) -> tuple[list[float], float]:
    """Per round, median step time with a snapshot every step / without; and the median
    step time without (seconds). The two trainers take turns (A B, B A, ...), each alive throughout."""
    trainers = {every: build(every) for every in (1, 0)}
    try:
        results = run_rounds({every: (lambda count, t=t: [t.step(*batch).step_time for _ in range(count)])
                              for every, t in trainers.items()}, args.rounds, args.steps, args.warmup,
                             on_round=lambda i, _: print(f"round {i + 1} done", flush=True), reverse_odd_rounds=True)
    finally:
        for subject in trainers.values():
            subject.shutdown()
    return round_ratios(results[1], results[0], args.steps), statistics.median(results[0])


def kill_trials(config, batch, kills: int) -> list[float]:
    """Seconds from each SIGKILL to the completion of the step it hit."""
    chooser, seconds = random.Random(0), []
    with trainer(config, 1) as subject:
        step_time = warm_up(subject, batch)
        for _ in range(kills):
            kill_trial(subject, batch, chooser, step_time, seconds)
    return seconds


def warm_up(subject: raypipe.PipelineTrainer, batch: tuple) -> float:
    """A first step, then the median of three: the step time kills are timed within."""
    subject.step(*batch)
    return statistics.median(subject.step(*batch).step_time for _ in range(3))


def kill_trial(subject: raypipe.PipelineTrainer, batch: tuple, chooser: random.Random, step_time: float,
               seconds: list[float]) -> None:
    """SIGKILL a random worker at a random moment of a step; append the seconds to that step's end."""
    victim = chooser.choice(subject.workers)
    delay = chooser.uniform(0.0, step_time)
    killed_at = []
    timer = threading.Timer(delay, lambda: (killed_at.append(time.monotonic()), os.kill(victim.pid, signal.SIGKILL)))
    timer.start()
    subject.step(*batch)
    if killed_at:
        seconds.append(time.monotonic() - killed_at[0])
    subject.step(*batch)  # a kill landing after its step is healed by this one


def spare_trials(config, batch, kills: int) -> tuple[dict[int, list[float]], list[str]]:
    """Kill trials on two trainers, with a warm spare (1) and without (0), in turns; the seconds
    of each, and where each heal with a spare came from (its recoveries' sources)."""
    choosers, seconds = {spares: random.Random(spares) for spares in (1, 0)}, {1: [], 0: []}
    subjects = {spares: trainer(config, 1, spares) for spares in (1, 0)}
    try:
        step_times = {spares: warm_up(subject, batch) for spares, subject in subjects.items()}
        for trial in range(kills):
            for spares in ((1, 0) if trial % 2 == 0 else (0, 1)):
                if spares:  # the spare started after the last heal is up (as one is, a while after a heal)
                    assert subjects[1].spares.wait_until_up(300), "the new spare did not come up"
                kill_trial(subjects[spares], batch, choosers[spares], step_times[spares], seconds[spares])
            print(f"kill {trial + 1} done: {seconds[1][-1:]} s with a spare, {seconds[0][-1:]} s without", flush=True)
        sources = [recovered.source for recovered in subjects[1].recoveries]
    finally:
        for subject in subjects.values():
            subject.shutdown()
    return seconds, sources


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    config = get_config(MODEL)
    # address="local": a private instance, never another user's; 2 stages of one trainer at a time compute
    # with --spares: two trainers of 2 stages and a spare
    ray.init(address="local", num_cpus=6 if args.spares else 4, include_dashboard=False, logging_level="WARNING")
    rows = args.micro_batches * args.micro_batch_size
    batch = tokens(rows, config.max_seq_len, config.vocab_size)
    print(f"torch {torch.__version__}, ray {ray.__version__}; {args.rounds} rounds x {args.steps} steps; "
          f"llama: {MODEL} LLaMA, 2 stages, m={args.micro_batches} x {args.micro_batch_size} x "
          f"{config.max_seq_len} tokens, AdamW; mlp: {MLP_BLOCKS} blocks {MLP_WIDTH}->{MLP_HIDDEN}->{MLP_WIDTH}, "
          f"2 stages, m={MLP_MICRO_BATCHES} x {MLP_ROWS} rows, SGD", flush=True)
    contenders = {"llama": (lambda every: trainer(config, every), batch), "mlp": (mlp_trainer, mlp_batch())}
    rows_out = []
    if args.spares:
        try:
            seconds, sources = spare_trials(config, batch, args.kills)
        finally:
            ray.shutdown()
        print()
        print(f"heals with a spare, where the state came from: {sources}")
        print_table(["SIGKILL trials", "kills", "seconds from kill to the step done: median [min-max]"],
                    [["with a warm spare (spare_workers=1)", len(seconds[1]), spread(seconds[1], 2)],
                     ["without (a replacement started)", len(seconds[0]), spread(seconds[0], 2)]])
        print(command_line())
        return
    try:
        for model in args.models:
            ratios, plain = snapshot_cost(*contenders[model], args)
            rows_out.append([f"{model}: step time snapshot_every=1 / snapshot_every=0", spread(ratios),
                             f"{plain * 1000:.0f}"])
        print()
        print_table(["ratio (target <= 1.03)", "median [min-max] of per-round ratios", "ms a step without"],
                    rows_out)
        seconds = kill_trials(config, batch, args.kills) if args.kills else []
    finally:
        ray.shutdown()
    if seconds:
        print()
        print_table(["SIGKILL trials", "seconds from kill to the step done: median [min-max]"],
                    [[len(seconds), spread(seconds, 1)]])
    print(command_line())


if __name__ == "__main__":
    main()
