"""Compound faults on real processes, with Ray's default health checks: a second
worker lost while a heal runs, a replacement that dies while it starts, a worker
lost during an evaluation (and another during its heal), during a background
checkpoint write and during the snapshot copy.

Each sequence runs a fresh trainer (an MLP of 4 layers on 2 stages, 1 or 2
replicas, ``snapshot_every=1``, ``max_failures=None``) for ``--steps`` steps on one
local Ray instance started with Ray's default system config (no shortened
health-check or kill timeouts). The faults are real: SIGKILL of a worker process,
or ``ray.kill`` of a replacement as it starts; the moments inside a heal are the
heal's own (a hook in the driver kills just before the heal gives state), so every
sequence is the same on every run. Printed per sequence: the outcome (``healed,
bitwise`` when every step's loss and the final parameters equal an uninterrupted
run's of the same layout; else what differed, or the error raised), the failure
events and heals, and the seconds from the first kill to the end of the step
(or call) that healed it.

    python benchmarks/bench_compound_faults.py
    python benchmarks/bench_compound_faults.py --only second-kill-during-restore --steps 6

Not run here (they need a multi-node cluster, or room that comes and goes): a
loss during a shrink, a grow's admission and a partition swap; the deterministic
harness (tests/control/test_compound_faults.py) covers those, and
tests/executor/repartition_run.py runs a swap in place on a ray.cluster_utils.Cluster.
"""
from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager

import ray
import torch
from torch import nn

import raypipe
from raypipe.control.snapshots import Snapshots
from raypipe.control.state_transfer import StateTransfer
from raypipe.runtime.group import StageGroup

WIDTH, LAYERS, BATCH = 32, 4, 8


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))
            for _ in range(steps)]


def trainer(replicas: int) -> raypipe.PipelineTrainer:
    config = raypipe.PipelineConfig(num_stages=2, num_replicas=replicas, num_micro_batches=2, snapshot_every=1,
                                    max_failures=None)
    return raypipe.PipelineTrainer(model(), nn.functional.mse_loss,
                                   lambda params: torch.optim.AdamW(params, lr=1e-2), config)


@contextmanager
def once_before(owner: type, name: str, action: Callable[[], None]):
    """``owner.name`` runs ``action()`` first, the first time it is called (in the driver)."""
    original, done = getattr(owner, name), []

    def wrapped(self, *args, **kwargs):
        if not done:
            done.append(True)
            action()
        return original(self, *args, **kwargs)

    setattr(owner, name, wrapped)
    try:
        yield done
    finally:
        setattr(owner, name, original)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


class Sequence:
    """One compound fault: ``inject(trainer, step, run_step)`` runs step ``step`` with the faults
    around it and returns the seconds from the first kill to the end of what healed it."""

    def __init__(self, name: str, replicas: int, at: int, inject: Callable) -> None:
        self.name, self.replicas, self.at, self.inject = name, replicas, at, inject


def second_kill_while_healing(first: int, second: int) -> Callable:
    """Kill worker ``first`` (rank), then worker ``second`` just before the heal gives state."""
    def inject(trainer, step_once):
        survivor = trainer.workers[second].pid
        with once_before(StateTransfer, "transfer_state", lambda: kill(survivor)):
            start = time.monotonic()
            kill(trainer.workers[first].pid)
            step_once()
            return time.monotonic() - start
    return inject


def replacement_dies_while_it_starts(trainer, step_once):
    original = StageGroup.start_worker
    created = []

    def dying(self, index):
        actor = original(self, index)
        if not created:
            created.append(actor)
            ray.kill(actor)  # before it is ready, as one started into a lost node's bundle
        return actor

    StageGroup.start_worker = dying
    try:
        start = time.monotonic()
        kill(trainer.workers[0].pid)
        step_once()
        return time.monotonic() - start
    finally:
        StageGroup.start_worker = original


def kill_during_evaluate_and_its_heal(trainer, step_once):
    x, y = batches(1)[0]
    survivor = trainer.workers[0].pid
    with once_before(StateTransfer, "transfer_state", lambda: kill(survivor)):
        start = time.monotonic()
        kill(trainer.workers[1].pid)
        trainer.evaluate(x, y)
        seconds = time.monotonic() - start
    step_once()
    return seconds


def kill_during_background_checkpoint_write(trainer, step_once, root="/tmp/bench_compound_faults_ckpt"):
    trainer.save_checkpoint(root, wait=False)
    start = time.monotonic()
    kill(trainer.workers[1].pid)
    step_once()
    return time.monotonic() - start


def kill_during_snapshot_copy(trainer, step_once):
    start = []

    def killing_after(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not start and not kwargs.get("first"):  # a snapshot of committed steps, not a heal's own
            start.append(time.monotonic())
            kill(trainer.workers[1].pid)
        return result

    original, heals = Snapshots.take, len(trainer.recoveries)
    Snapshots.take = killing_after
    try:
        while len(trainer.recoveries) == heals:  # the kill lands as the snapshot is copied; a step heals it
            step_once()
    finally:
        Snapshots.take = original
    return time.monotonic() - start[0]


SEQUENCES = [
    Sequence("second-kill-during-restore", 1, 3, second_kill_while_healing(0, 1)),
    # replica 0 stage 1 (rank 1) is the source of replica 1 stage 1's (rank 3) state
    Sequence("second-kill-during-sibling-copy", 2, 3, second_kill_while_healing(3, 1)),
    Sequence("replacement-dies-while-it-starts", 1, 3, replacement_dies_while_it_starts),
    Sequence("kill-during-evaluate-and-its-heal", 1, 3, kill_during_evaluate_and_its_heal),
    Sequence("kill-during-background-checkpoint-write", 1, 3, kill_during_background_checkpoint_write),
    Sequence("kill-during-snapshot-copy", 1, 3, kill_during_snapshot_copy),
]


def run(replicas: int, steps: int, sequence: Sequence | None = None) -> dict:
    data = iter(batches(steps))
    losses, seconds = [], None
    with trainer(replicas) as running:
        def step_once():
            x, y = next(data)
            losses.append(running.step(x, y).loss)

        while len(losses) < steps:
            if sequence is not None and len(losses) == sequence.at and seconds is None:
                seconds = sequence.inject(running, step_once)
            else:
                step_once()
        return {"losses": losses, "state": running.state_dict(), "seconds": seconds,
                "failures": list(running.failures), "heals": len(running.recoveries)}


def outcome(expected: dict, got: dict) -> str:
    if got["losses"] != expected["losses"]:
        return "healed, losses differ"
    differing = [name for name, tensor in expected["state"].items() if not torch.equal(tensor, got["state"][name])]
    return f"healed, {len(differing)} parameter(s) differ" if differing else "healed, bitwise"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="+", choices=[sequence.name for sequence in SEQUENCES])
    args = parser.parse_args()
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False,
             logging_level="WARNING")  # Ray's default system config: its own health-check periods and timeouts
    references: dict[int, dict] = {}
    print(f"{'sequence':42s} {'outcome':32s} {'failures':>8s} {'heals':>5s} {'seconds':>8s}")
    for sequence in SEQUENCES:
        if args.only and sequence.name not in args.only:
            continue
        if sequence.replicas not in references:
            references[sequence.replicas] = run(sequence.replicas, args.steps)
        try:
            got = run(sequence.replicas, args.steps, sequence)
            line = (f"{outcome(references[sequence.replicas], got):32s} {len(got['failures']):8d} {got['heals']:5d} "
                    f"{got['seconds']:8.1f}")
        except Exception as error:  # noqa: BLE001 - the outcome to report
            line = f"raised {type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}"
        print(f"{sequence.name:42s} {line}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
