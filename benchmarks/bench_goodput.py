"""Measured goodput under injected failures, beside the goodput model's prediction
(``raypipe/planning/segment_model.py``) for the same fault rate, step time and recovery.

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
model of :mod:`raypipe.planning.segment_model` (``E[wall of a step] = (exp(l S) - 1)(1/l + R)``) with
the measured step ``S`` and recovery ``R`` (detection + replacement) either from
``bench_recovery``'s figures (the model's defaults; with ``--spares``, their mix for the share of
kills that find the spare back, :func:`~raypipe.planning.spare_availability.spare_ready_fraction`) or from
this run's kills (the struck steps' time beyond a plain step, per kill, less the half step lost on
average); the failure rate ``l`` nominal (1 / ``--mtbf-s``) or as realised (kills / seconds
outside heals).

    python benchmarks/bench_goodput.py --seconds 240 --mtbf-s 20
    python benchmarks/bench_goodput.py --seconds 240 --mtbf-s 20 --spares

``--every-steps K [K ...]`` measures instead the issue's goodput, side by side in one run: for
each spare setting (none, ``spare_workers=1``), ``--steps`` steps uninterrupted, then for each K
the same steps with one SIGKILL of a random live worker at a random moment in a random step of
every block of K steps (seeded; the moment a uniform fraction of an uninterrupted step after the
step starts). Goodput = the uninterrupted runs' wall seconds / the faulted run's, the uninterrupted
run made before the faulted ones and again after (their mean; the range against each: on 2 shared
cores one run's steps can be ~10% slower than the next's, as much as the kills cost); every faulted
run's final parameters are compared bitwise with the first uninterrupted run's. Predicted with
``bench_recovery``'s R (the model's default) and with the R of this run's own kills without a spare. With a spare, the
prediction takes the share of kills that find one up from the model's replenishment time and this
kill process (kills a triangular interval apart: :func:`~raypipe.planning.spare_availability.block_failures_within`);
the run reports the share that did (heals naming a spare) and each replenishment it saw (from a
spare taken to the next one up, polled every 0.1 s).

    python benchmarks/bench_goodput.py --every-steps 20 50 --steps 200
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
from raypipe.planning.goodput import GoodputAssumptions
from raypipe.planning.segment_model import segment_goodput, simulate_segments
from raypipe.planning.spare_availability import (block_failures_within, poisson_spare_ready_fraction,
                                                 spare_mixed_recovery_s, spare_ready_fraction)

MODEL = "tiny"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=240.0, help="length of the run with kills (default 240)")
    parser.add_argument("--mtbf-s", type=float, default=20.0, help="mean seconds between kills (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times and victims (default 0)")
    parser.add_argument("--save", default=None, metavar="JSON", help="write the steps' and kills' times here")
    parser.add_argument("--spares", action="store_true", help="spare_workers=1 (a warm spare replaces a worker)")
    parser.add_argument("--every-steps", type=int, nargs="+", default=None, metavar="K",
                        help="one kill per K steps, each K against an uninterrupted run, with and without a spare")
    parser.add_argument("--steps", type=int, default=200, help="steps per run with --every-steps (default 200)")
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
            if not _kill_a_live_worker(self.subject, self.rng, self.kills):
                self.missed += 1  # mid-heal: no failure now
            next_at += self.rng.expovariate(1.0 / self.mtbf_s)


class SpareWatch(threading.Thread):
    """Polls a trainer's spare pool every 0.1 s for the seconds from a heal taking its spare (none
    up) to the next one up: the replenishment the goodput model assumes (``spare_replenish_s``),
    from the take rather than the heal's end (a spare's heal goes on ~0.1-0.3 s after it)."""

    def __init__(self, subject: raypipe.PipelineTrainer) -> None:
        super().__init__(daemon=True)
        self.pool = subject.spares
        self.seconds: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        taken_at = None
        while not self.stop.wait(0.1):
            up = self.pool.up_count() > 0
            if not up and taken_at is None:
                taken_at = time.monotonic()
            elif up and taken_at is not None:
                self.seconds.append(time.monotonic() - taken_at)
                taken_at = None


def _trainer(spares: int) -> raypipe.PipelineTrainer:
    """The subject, warmed up (its first steps build and compile), its spare up."""
    config = get_config(MODEL)
    subject = raypipe.PipelineTrainer(llama_layers(config), llama_loss, adamw, raypipe.PipelineConfig(
        num_stages=2, num_micro_batches=4, clip_grad_norm=1.0, snapshot_every=1, max_failures=None,
        spare_workers=spares))
    batch = tokens(8, config.max_seq_len, config.vocab_size)
    for _ in range(5):
        subject.step(*batch)
    if spares:
        assert subject.spares.wait_until_up(300), "the spare did not come up"
    return subject


def _kill_a_live_worker(subject: raypipe.PipelineTrainer, rng: random.Random, kills: list[float]) -> bool:
    """SIGKILL a random worker and note when; False mid-heal (the layout lists the dead worker until it is
    replaced), when no failure is injected."""
    workers = subject.workers
    if not all(_alive(worker.pid) for worker in workers):
        return False
    os.kill(rng.choice(workers).pid, signal.SIGKILL)
    kills.append(time.monotonic())
    return True


def _run_steps(spares: int, steps: int, kill_at: dict[int, float]) -> dict:
    """``steps`` steps; before step i in ``kill_at`` a timer kills a random live worker
    ``kill_at[i]`` seconds later. Wall seconds, the final parameters, kills and failures."""
    config = get_config(MODEL)
    batch = tokens(8, config.max_seq_len, config.vocab_size)
    subject, rng, kills, timers = _trainer(spares), random.Random(len(kill_at)), [], []
    watch = SpareWatch(subject) if spares and kill_at else None
    try:
        if watch:
            watch.start()
        start = time.monotonic()
        for index in range(steps):
            if index in kill_at:
                timers.append(threading.Timer(kill_at[index], _kill_a_live_worker, (subject, rng, kills)))
                timers[-1].start()
            subject.step(*batch)
        wall = time.monotonic() - start
        for timer in timers:  # none may fire after the last step: its heal would not count in the wall
            assert not timer.is_alive(), "a kill came after the last step"
        return {"wall": wall, "state": subject.state_dict(), "kills": len(kills),
                "failures": list(subject.failures), "recoveries": len(subject.recoveries),
                "spare_heals": sum("replaced by spare" in heal.source for heal in subject.recoveries),
                "replenish_s": list(watch.seconds) if watch else []}
    finally:
        if watch:
            watch.stop.set()
            watch.join()
        subject.shutdown()


def _predicted_goodput(model: GoodputAssumptions, step_s: float, every: int, spares: int,
                       recovery_without_spare_s: float) -> tuple[float, float]:
    """The segment model's goodput for one kill per block of ``every`` steps (the failure clock
    stopped in heals), and the share of kills predicted to find a spare (0 without spares): a kill
    finds one if the kill that used the last came the replenishment before, the refill going on
    through the heals without one."""
    ready = spare_ready_fraction(model.spare_replenish_s, block_failures_within(every * step_s),
                                 recovery_without_spare_s) if spares else 0.0
    recovery = spare_mixed_recovery_s(ready, model.detection_s + model.replacement_with_spare_s,
                                      recovery_without_spare_s)
    return segment_goodput(step_s, step_s, recovery, 1.0 / (every * step_s), failures_during_recovery=False), ready


def every_steps(args: argparse.Namespace) -> None:
    """Goodput with one kill per K steps against the uninterrupted run (see the docstring)."""
    model = GoodputAssumptions()
    rows, measured_recovery = [], None
    for spares in (0, 1):
        # uninterrupted before and after the faulted runs: on 2 shared cores a run's steps drift by
        # ~10% from one run to the next, as much as a few kills cost, so the goodput is given against
        # both (their mean, and [min-max])
        before = _run_steps(spares, args.steps, {})
        faulted = []
        for every in args.every_steps:
            step_s = before["wall"] / args.steps
            rng = random.Random(args.seed * 1000 + every)
            # a kill's step is never the last one, so a kill that comes after its step ended strikes the next
            kill_at = {block + rng.randrange(min(every, args.steps - 1 - block)): rng.random() * step_s
                       for block in range(0, args.steps - every + 1, every)}
            faulted.append((every, _run_steps(spares, args.steps, kill_at)))
        after = _run_steps(spares, args.steps, {})
        reference_wall = (before["wall"] + after["wall"]) / 2
        step_s = reference_wall / args.steps
        for every, run in faulted:
            equal = all(torch.equal(run["state"][name], value) for name, value in before["state"].items())
            lost = (run["wall"] - reference_wall) / max(1, run["kills"])
            if not spares and measured_recovery is None:
                measured_recovery = max(0.0, lost - step_s / 2)  # R of this run: a kill's loss less half a step
            predicted = [_predicted_goodput(model, step_s, every, spares, without_spare)
                         for without_spare in (model.detection_s + model.replacement_without_spare_s,
                                               measured_recovery)]
            ready = predicted[1][1]  # the share of kills finding a spare, with this run's R
            goodputs = [reference["wall"] / run["wall"] for reference in (before, after)]
            replenish = (f"{statistics.median(run['replenish_s']):.1f} [{min(run['replenish_s']):.1f}-"
                         f"{max(run['replenish_s']):.1f}]") if run["replenish_s"] else ""
            rows.append([f"spare_workers={spares}", every, args.steps, run["kills"], run["recoveries"],
                         f"{step_s * 1000:.0f} ms", f"{before['wall']:.1f} / {after['wall']:.1f}",
                         f"{run['wall']:.1f}", f"{lost:.2f}",
                         f"**{reference_wall / run['wall']:.3f}** [{min(goodputs):.3f}-{max(goodputs):.3f}]",
                         f"{predicted[0][0]:.3f}", f"{predicted[1][0]:.3f}",
                         f"{run['spare_heals']} / {ready * run['kills']:.1f}" if spares else "",
                         replenish, "yes" if equal else "**NO**"])
            print(rows[-1], f"failures: {run['failures']}, replenishments: "
                            f"{[round(x, 2) for x in run['replenish_s']]}", flush=True)
    print()
    print_table(["spares", "K", "steps", "kills", "heals", "uninterrupted step",
                 "uninterrupted wall before / after, s", "faulted wall, s", "s lost per kill",
                 "goodput [against before, after]", "predicted (bench_recovery's R)",
                 f"predicted (this run's R, {measured_recovery:.2f} s)",
                 "kills finding a spare: measured / predicted",
                 f"spare taken to up, s (model {model.spare_replenish_s:g})", "final state bitwise equal"], rows)
    print(command_line())


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    config = get_config(MODEL)
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    if args.every_steps:
        try:
            every_steps(args)
        finally:
            ray.shutdown()
        return
    batch = tokens(8, config.max_seq_len, config.vocab_size)
    spares = 1 if args.spares else 0
    subject = _trainer(spares)
    try:
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
    with_spare = model.detection_s + model.replacement_with_spare_s
    without_spare = model.detection_s + model.replacement_without_spare_s
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
    for label, from_run in (("bench_recovery's figures (the model's defaults)", False), ("this run's kills", True)):
        for rate_label, rate in (("nominal", nominal), ("realised", realised)):
            spared = spares and not from_run  # the measured R already holds the kills that found no spare
            if from_run:
                recovery = recovery_run
            elif spares:  # a share of the kills finds the spare still coming back
                ready = poisson_spare_ready_fraction(rate, model.spare_replenish_s, with_spare, without_spare,
                                                     failures_during_recovery=False)
                recovery = spare_mixed_recovery_s(ready, with_spare, without_spare)
            else:
                recovery = without_spare
            closed = segment_goodput(step_s, step_s, recovery, rate, failures_during_recovery=False)
            # the Monte Carlo draws each kill's spare: up (a spare's recovery) or still refilling
            simulated, _ = simulate_segments(step_s, step_s, with_spare if spared else recovery, rate, 2000 / rate,
                                             random.Random(args.seed), failures_during_recovery=False,
                                             recovery_without_spare_s=without_spare if spared else None,
                                             spare_replenish_s=model.spare_replenish_s)
            check = " (a consistency check: R and the rate come from the lost time itself)" \
                if from_run and rate is realised else ""
            rows.append([f"predicted, R from {label}, rate {rate_label}{check}", f"{closed:.1%}",
                         f"{simulated:.1%}", f"R={recovery:.2f} s, 1/rate={1 / rate:.1f} s, "
                         f"{closed - measured:+.1%} vs measured"])
    print()
    print_table(["goodput", "closed form", "Monte Carlo", "inputs"], rows)
    print(command_line())


if __name__ == "__main__":
    main()
