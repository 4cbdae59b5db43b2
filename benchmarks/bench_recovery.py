"""Fault tolerance on CPU: what in-memory snapshots cost per step, and how long a
killed worker takes to heal.

Two trainers of the tiny LLaMA on 2 stages (p2p executor, AdamW, clip 1.0),
alternating round by round on one local Ray instance:

* ``snapshot_every=1``: every worker snapshots its state after every step (copied
  as it first waits in the next one);
* ``snapshot_every=0``: no snapshots (a failure would be fatal).

Printed: the per-round step-time ratio of the two (median and min-max), then
for ``--kills`` trials the seconds from SIGKILL of a seeded-random worker,
at a seeded-random moment of a step, to that step's completion (detection,
replacement of the worker, restore of every worker, redo of the step), and its
split as logged by raypipe.

    python benchmarks/bench_recovery.py --rounds 8 --steps 4 --kills 5
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

import raypipe
from alternate import add_round_arguments, command_line, print_table, round_ratios, run_alternating, spread
from bench_data_parallel import adamw, tokens  # the same optimizer and token batches
from raypipe.models.llama import get_config, llama_layers, llama_loss

MODEL = "tiny"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=8, steps=4, warmup=2)
    parser.add_argument("--kills", type=int, default=5, help="SIGKILL trials (default 5)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    return parser.parse_args()


def trainer(config, snapshot_every: int) -> raypipe.PipelineTrainer:
    return raypipe.PipelineTrainer(llama_layers(config), llama_loss, adamw, raypipe.PipelineConfig(
        num_stages=2, num_micro_batches=4, clip_grad_norm=1.0, snapshot_every=snapshot_every, max_failures=None))


def kill_trials(config, batch, kills: int) -> list[float]:
    """Seconds from each SIGKILL to the completion of the step it hit."""
    chooser, seconds = random.Random(0), []
    with trainer(config, 1) as subject:
        subject.step(*batch)
        step_time = statistics.median(subject.step(*batch).step_time for _ in range(3))
        for _ in range(kills):
            victim = chooser.choice(subject.workers)
            delay = chooser.uniform(0.0, step_time)
            killed_at = []
            timer = threading.Timer(delay, lambda: (killed_at.append(time.monotonic()),
                                                    os.kill(victim.pid, signal.SIGKILL)))
            timer.start()
            subject.step(*batch)
            if killed_at:
                seconds.append(time.monotonic() - killed_at[0])
            subject.step(*batch)  # a kill landing after its step is healed by this one
    return seconds


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    config = get_config(MODEL)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    rows = args.micro_batches * args.micro_batch_size
    batch = tokens(rows, config.max_seq_len, config.vocab_size)
    print(f"torch {torch.__version__}, ray {ray.__version__}; {MODEL} LLaMA, 2 stages, m={args.micro_batches} x "
          f"{args.micro_batch_size} x {config.max_seq_len} tokens, AdamW; {args.rounds} rounds x {args.steps} steps",
          flush=True)
    trainers = {"snapshot_every=1": trainer(config, 1), "snapshot_every=0": trainer(config, 0)}
    results = run_alternating(trainers, {name: batch for name in trainers}, args,
                              on_round=lambda i, _: print(f"round {i + 1} done", flush=True))

    def times(name):
        return [r.step_time for r in results[name]]

    print()
    print_table(["ratio", "median [min-max] of per-round ratios"], [
        ["step time snapshot_every=1 / snapshot_every=0", spread(round_ratios(times("snapshot_every=1"),
                                                                              times("snapshot_every=0"), args.steps))],
    ])
    seconds = kill_trials(config, batch, args.kills)
    print()
    print_table(["SIGKILL trials", "seconds from kill to the step done: median [min-max]"],
                [[len(seconds), spread(seconds, 1) if seconds else "-"]])
    print(command_line())


if __name__ == "__main__":
    main()
