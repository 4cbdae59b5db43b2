"""A hung worker's heal on CPU: Ray's default kill grace against the 1 s raypipe sets.

A raylet told to kill a worker sends SIGTERM and SIGKILLs it after
``kill_worker_timeout_milliseconds`` if it has not exited. A hung stage worker
never exits on its own, and its neighbours' receives from it end only once it is
gone. Each trial is a process of its own with its own local Ray instance (the
setting is the instance's): the tiny LLaMA on 2 stages (p2p executor, AdamW, clip
1.0, ``hang_timeout_s=3``), two steps, then SIGSTOP of stage 1 at a seeded-random
moment of the first half of the third, whose wall time is measured to its end. The contenders take
turns, one trial each per round, A B, B A, ...

Printed: per round the ratio of the seconds from SIGSTOP to the step done (Ray's
default / 1 s), its median and min-max, and each contender's seconds.

    python benchmarks/bench_hang_heal.py --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from alternate import command_line, print_table, run_rounds, spread

CONTENDERS = {"Ray's default": None, "1000 ms": 1000}


def trial(grace_ms: int | None, seed: int) -> float:
    """In this process: seconds from the SIGSTOP of stage 1 to the end of its step."""
    import ray
    import torch

    import raypipe
    from bench_data_parallel import adamw, tokens
    from raypipe.models.llama import get_config, llama_layers, llama_loss

    torch.set_num_threads(1)
    system_config = {} if grace_ms is None else {"kill_worker_timeout_milliseconds": grace_ms}
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", _system_config=system_config)
    model = get_config("tiny")
    batch = tokens(8, model.max_seq_len, model.vocab_size)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=4, clip_grad_norm=1.0, hang_timeout_s=3.0,
                                    max_failures=None)
    with raypipe.PipelineTrainer(llama_layers(model), llama_loss, adamw, config) as trainer:
        step_time = min(trainer.step(*batch).step_time for _ in range(2))
        victim = trainer.workers[1].pid
        stopped_at = []
        threading.Timer(random.Random(seed).uniform(0.0, step_time / 2),  # inside the step
                        lambda: (stopped_at.append(time.monotonic()), os.kill(victim, signal.SIGSTOP))).start()
        trainer.step(*batch)
        assert stopped_at and trainer.failures, "the stop landed after its step"
        return time.monotonic() - stopped_at[0]


def run_trial(name: str, seed: int) -> float:
    done = subprocess.run([sys.executable, __file__, "--trial", json.dumps([CONTENDERS[name], seed])],
                          cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"trial {name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    parser.add_argument("--trial", help=argparse.SUPPRESS)  # [grace_ms, seed]: one trial, in this process
    args = parser.parse_args()
    if args.trial:
        print(trial(*json.loads(args.trial)))
        return
    print(command_line())
    trials = {name: 0 for name in CONTENDERS}  # the k-th trial of each stops at the same seeded moment

    def contender(name: str):
        def run(count: int) -> list[float]:
            trials[name] += count
            return [run_trial(name, seed) for seed in range(trials[name] - count, trials[name])]
        return run

    def done(index: int, _) -> None:
        print(f"round {index + 1} done", flush=True)

    results = run_rounds({name: contender(name) for name in CONTENDERS}, args.rounds, steps=1, warmup=0,
                         reverse_odd_rounds=True, on_round=done)
    default, short = results["Ray's default"], results["1000 ms"]
    ratios = [a / b for a, b in zip(default, short)]
    print()
    print_table(["figure", "median [min-max]"], [
        ["seconds from SIGSTOP to the step done, Ray's default / 1000 ms", spread(ratios)],
        ["seconds, Ray's default", spread(default, 1)], ["seconds, 1000 ms", spread(short, 1)],
    ])
    print(command_line())


if __name__ == "__main__":
    main()
