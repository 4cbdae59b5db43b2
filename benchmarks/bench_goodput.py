"""Measured goodput under injected failures, beside the goodput model's prediction
(``raypipe/planning/goodput.py``) for the same fault rate, step time and recovery.

The tiny LLaMA on 2 stages (p2p executor, AdamW, clip 1.0, m=4, ``snapshot_every=1``) on a
local Ray instance trains for ``--seconds`` while a thread SIGKILLs a random live worker at
seeded Poisson times (mean ``--mtbf-s`` seconds apart: the whole job's failure rate). A kill
time that falls in a heal is dropped: the failure clock stops during recoveries, and the
prediction is the model's form for that (``failures_during_recovery=False``). At a real
cluster's rates (a recovery of seconds, a failure every hours) the two forms agree; at one
kill per ~20 s they differ by points, and a survivor killed mid-heal on 2 CPU cores is another
event (both workers replaced, 20-30 s under load). Measured goodput = useful step seconds / the
run's wall seconds, where the useful seconds are the durations of the steps no kill struck plus,
for each struck step, the mean of those (what it would have taken). Predicted: the segment
model of :mod:`raypipe.planning.goodput` (``E[wall of a step] = (exp(l S) - 1)(1/l + R)``) with
the measured step ``S`` and recovery ``R`` (detection + replacement) either from
``bench_recovery``'s figures (the model's defaults) or from this run's kills (the struck steps'
time beyond a plain step, per kill, less the half step lost on average); the failure rate ``l``
nominal (1 / ``--mtbf-s``) or as realised (kills / seconds outside heals).

    python benchmarks/bench_goodput.py --seconds 240 --mtbf-s 20
    python benchmarks/bench_goodput.py --seconds 240 --mtbf-s 20 --spares
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import signal
import statistics
import threading
import time

import ray
import torch

import raypipe
from alternate import command_line, print_table
from bench_data_parallel import adamw, tokens
from raypipe.models.llama import get_config, llama_layers, llama_loss
from raypipe.planning.goodput import GoodputAssumptions, segment_goodput, simulate_segments

MODEL = "tiny"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=240.0, help="length of the run with kills (default 240)")
    parser.add_argument("--mtbf-s", type=float, default=20.0, help="mean seconds between kills (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times and victims (default 0)")
    parser.add_argument("--save", default=None, metavar="JSON", help="write the steps' and kills' times here")
    parser.add_argument("--spares", action="store_true", help="spare_workers=1 (a warm spare replaces a worker)")
    return parser.parse_args()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Killer(threading.Thread):
    """SIGKILLs a random live worker at Poisson times until stopped; records each kill's moment."""

    def __init__(self, subject: raypipe.PipelineTrainer, mtbf_s: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.subject, self.mtbf_s, self.rng = subject, mtbf_s, random.Random(seed)
        self.kills: list[float] = []  # the moments of kills of a live worker
        self.missed = 0  # kill times that fell in a heal, dropped (the failure clock stopped)
        self.stop = threading.Event()

    def run(self) -> None:
        next_at = time.monotonic() + self.rng.expovariate(1.0 / self.mtbf_s)
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            workers = self.subject.workers
            if all(_alive(worker.pid) for worker in workers):
                os.kill(self.rng.choice(workers).pid, signal.SIGKILL)
                self.kills.append(time.monotonic())
            else:  # mid-heal (the layout lists the dead worker until it is replaced): no failure now
                self.missed += 1
            next_at += self.rng.expovariate(1.0 / self.mtbf_s)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    config = get_config(MODEL)
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    batch = tokens(8, config.max_seq_len, config.vocab_size)
    spares = 1 if args.spares else 0
    subject = raypipe.PipelineTrainer(llama_layers(config), llama_loss, adamw, raypipe.PipelineConfig(
        num_stages=2, num_micro_batches=4, clip_grad_norm=1.0, snapshot_every=1, max_failures=None,
        spare_workers=spares))
    try:
        for _ in range(5):  # warm-up: the first steps build and compile
            subject.step(*batch)
        if spares:
            assert subject._group.spares.wait_until_up(300), "the spare did not come up"
        killer = Killer(subject, args.mtbf_s, args.seed)
        steps: list[tuple[float, float]] = []
        start = time.monotonic()
        killer.start()
        while time.monotonic() - start < args.seconds:
            began = time.monotonic()
            subject.step(*batch)
            steps.append((began, time.monotonic()))
        killer.stop.set()
        killer.join()
        end = steps[-1][1]
        failures = list(subject.failures)
    finally:
        subject.shutdown()
        ray.shutdown()
    kills = [k for k in killer.kills if k <= end]
    wall = end - start
    ends = [b for _, b in steps]
    hit = {bisect.bisect_left(ends, k) for k in kills}  # the steps a kill struck (or, between steps, the next)
    unhit = [b - a for index, (a, b) in enumerate(steps) if index not in hit]
    step_s = statistics.fmean(unhit)
    measured = (sum(unhit) + len(hit) * step_s) / wall  # a struck step's useful part: one plain step
    to_done = [ends[bisect.bisect_left(ends, k)] - k for k in kills]  # each kill to the end of the step it hit
    # per failure, the lost time is the partial step (S/2 on average) plus R; a step struck twice
    # (a kill while it is redone) counts once, so R comes from the struck steps' whole excess
    lost = sum(steps[index][1] - steps[index][0] - step_s for index in hit)
    recovery_run = max(0.0, lost / len(kills) - step_s / 2) if kills else 0.0
    model = GoodputAssumptions()
    replacement = model.replacement_with_spare_s if spares else model.replacement_without_spare_s
    recovery_bench = model.detection_s + replacement
    up = wall - len(kills) * recovery_run  # the failure clock runs outside heals
    nominal, realised = 1.0 / args.mtbf_s, len(kills) / up
    print(f"torch {torch.__version__}, ray {ray.__version__}; tiny LLaMA, 2 stages, m=4 x 2 x {config.max_seq_len} "
          f"tokens, AdamW, snapshot_every=1, spare_workers={spares}; {len(steps)} steps in {wall:.1f} s, "
          f"{len(kills)} kills of a live worker ({killer.missed} more fell in a heal, dropped; "
          f"{len(failures)} failures healed), mean step not struck {step_s * 1000:.0f} ms")
    print(f"failures: {failures}")
    print(f"seconds from each kill to its step done: {[round(x, 2) for x in to_done]}")
    if args.save:
        with open(args.save, "w") as out:
            json.dump({"steps": steps, "kills": kills, "start": start, "missed": killer.missed}, out)
    rows = [["measured: (steps not struck + one step per struck step) / wall", f"{measured:.1%}", "", ""]]
    for label, recovery in (("bench_recovery's figures (the model's defaults)", recovery_bench),
                            ("this run's kills", recovery_run)):
        for rate_label, rate in (("nominal", nominal), ("realised", realised)):
            closed = segment_goodput(step_s, step_s, recovery, rate, failures_during_recovery=False)
            simulated, _ = simulate_segments(step_s, step_s, recovery, rate, 2000 / rate, random.Random(args.seed),
                                             failures_during_recovery=False)
            check = " (a consistency check: R and the rate come from the lost time itself)" \
                if recovery is recovery_run and rate is realised else ""
            rows.append([f"predicted, R from {label}, rate {rate_label}{check}", f"{closed:.1%}",
                         f"{simulated:.1%}", f"R={recovery:.2f} s, 1/rate={1 / rate:.1f} s, "
                         f"{closed - measured:+.1%} vs measured"])
    print()
    print_table(["goodput", "closed form", "Monte Carlo", "inputs"], rows)
    print(command_line())


if __name__ == "__main__":
    main()
