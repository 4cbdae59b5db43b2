"""Checkpoint saves on CPU: what saving every step costs ``fit``, blocking vs in the background.

Three trainers of the tiny LLaMA on 2 stages (p2p executor, AdamW), each running
``fit`` on its own copy of a small prepared dataset (the stdlib corpus),
alternating round by round on one local Ray instance:

* ``none``: no checkpoints;
* ``background``: ``checkpoint_every=1`` as ``fit`` saves (``wait=False``: the
  workers copy their state to host memory and write it on a thread of their own
  while the next step runs);
* ``blocking``: ``checkpoint_every=1``, each save waited for before the next step
  (the callback calls ``wait_for_checkpoint``: the pre-background behaviour).

A step's time is the wall-clock time between ``fit``'s consecutive callbacks
(step, save, callback: everything a step of the loop costs). Printed: per round the
ratios background/none and blocking/none (median and min-max over rounds), and the
median seconds of a background save from its start to its manifest.

    python benchmarks/bench_checkpoint.py --rounds 6 --steps 4
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

import raypipe
from alternate import add_round_arguments, command_line, print_table, round_ratios, run_rounds, spread
from bench_data_parallel import adamw  # the same optimizer
from raypipe.data import TokenDataset, prepare
from raypipe.models.llama import get_config, llama_layers, llama_loss
from raypipe.run import llama_count_tokens

MODEL = "tiny"
CONTENDERS = ("none", "background", "blocking")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=6, steps=4, warmup=1)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    return parser.parse_args()


class Contender:
    """One trainer and its dataset; :meth:`run` runs ``fit`` and times its steps."""

    def __init__(self, name: str, data: Path, root: Path, args: argparse.Namespace) -> None:
        self.name, self.root = name, root
        self.dataset = TokenDataset(data, "train", args.micro_batch_size, args.micro_batches)
        self.trainer = raypipe.PipelineTrainer(
            llama_layers(get_config(MODEL)), llama_loss, adamw,
            raypipe.PipelineConfig(num_stages=2, num_micro_batches=args.micro_batches),
            loss_count_fn=llama_count_tokens)
        self.save_seconds: list[float] = []

    def run(self, count: int) -> list[float]:
        """``count`` step times: ``fit`` runs one more step, the intervals between its callbacks."""
        marks: list[float] = []

        def callback(_result) -> None:
            if self.name == "blocking":
                self.save_seconds.append(self.trainer.wait_for_checkpoint().seconds)
            marks.append(time.monotonic())

        saving = {} if self.name == "none" else {"checkpoint_dir": str(self.root), "checkpoint_every": 1,
                                                 "keep_last": 2}
        self.trainer.fit(self.dataset, count + 1, progress=False, callback=callback, **saving)
        return [later - earlier for earlier, later in zip(marks, marks[1:])]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    ray.init(num_cpus=6, include_dashboard=False, logging_level="WARNING")  # 3 trainers x 2 stages
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint-") as scratch:
        scratch = Path(scratch)
        config = get_config(MODEL)
        data = prepare(scratch / "tokens", seq_len=config.max_seq_len, max_bytes=4_000_000)
        contenders = {name: Contender(name, data, scratch / name, args) for name in CONTENDERS}
        print(f"torch {torch.__version__}, ray {ray.__version__}; {MODEL} LLaMA, 2 stages, m={args.micro_batches} x "
              f"{args.micro_batch_size} x {config.max_seq_len} tokens, AdamW; {args.rounds} rounds x {args.steps} "
              "steps", flush=True)
        try:
            times = run_rounds({name: contender.run for name, contender in contenders.items()}, args.rounds,
                               args.steps, args.warmup, on_round=lambda i, _: print(f"round {i + 1} done", flush=True))
        finally:
            for contender in contenders.values():
                contender.trainer.shutdown()
            ray.shutdown()
    print()
    print_table(["ratio", "median [min-max] of per-round ratios"], [
        [f"step time {name} / none", spread(round_ratios(times[name], times["none"], args.steps))]
        for name in ("background", "blocking")])
    median = {name: statistics.median(values) for name, values in times.items()}
    print()
    print_table(["contender", "median step time (s)"], [[name, f"{median[name]:.3f}"] for name in CONTENDERS])
    saves = contenders["blocking"].save_seconds
    print(f"\na save, from its start to its manifest (blocking contender): median {statistics.median(saves):.3f} s")
    print(command_line())


if __name__ == "__main__":
    main()
