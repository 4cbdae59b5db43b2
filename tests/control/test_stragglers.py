"""Slow workers found from their own compute, a pure decision on fabricated timelines (no Ray).

Parity: each case is a step history written out by hand (the acceptance's p = 4, d = 2 with one
worker slowed 2x from step 20 of 80; a whole replica slowed; a tensor-parallel rank and its
waiting peers; one replica alone; a stage slowed in every replica), and the workers it must name,
with the step they are found at, worked out from the rule in raypipe/control/stragglers.py's
docstring; the decision after (report or replace); and one unslowed run of the real step runner in
one process, whose measured timelines under this machine's noise must name no worker."""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from raypipe.control import stragglers
from raypipe.control.stragglers import (ComputeHistory, ComputeView, ReplaceSlow, ReportSlow, SlowView, SlowWorker,
                                        decide_slow, find_slow, own_compute, slowdowns)
from raypipe.core.result import OpEvent

WELL = {0: 0.040, 1: 0.050, 2: 0.050, 3: 0.060}  # seconds of compute per stage (layers differ), p = 4


def timeline(seconds: dict[tuple[int, int, int], float]) -> list[OpEvent]:
    """A step's events: each worker's compute as an F and a B of half its seconds each, with a receive
    and the optimizer around them (waiting and bookkeeping, not compute)."""
    events = []
    for (replica, stage, tp_rank), total in seconds.items():
        events += [OpEvent(stage, "recv", 0, 0.0, 0.5, replica, tp_rank=tp_rank),
                   OpEvent(stage, "F", 0, 1.0, 1.0 + total / 2, replica, tp_rank=tp_rank),
                   OpEvent(stage, "B", 0, 2.0, 2.0 + total / 2, replica, tp_rank=tp_rank),
                   OpEvent(stage, "optimizer", None, 3.0, 3.25, replica, tp_rank=tp_rank)]
    return events


def run(steps: int, seconds_at, slow_factor: float = 1.3, slow_steps: int = 10
        ) -> dict[int, tuple[SlowWorker, ...]]:
    """Record ``steps`` steps (``seconds_at(step)``: each worker's compute) and return, per step, the
    workers newly found slow at it."""
    history = ComputeHistory(slow_factor, slow_steps)
    found = {}
    for step in range(steps):
        history.record(timeline(seconds_at(step)))
        new = history.newly_slow(find_slow(history.view()))
        if new:  # factors to 6 places: the events' float times add their rounding
            found[step] = tuple(SlowWorker(*worker.worker, round(worker.factor, 6)) for worker in new)
    return found


def pipeline(replicas: int = 2, slowed: dict | None = None, jitter: random.Random | None = None,
             tensor_parallel: int = 1):
    """Each worker's compute at a step: its stage's, times ``slowed[(replica, stage, tp_rank)](step)``
    where given, times a little noise (seeded) where ``jitter`` is given."""
    slowed = slowed or {}

    def seconds_at(step: int) -> dict[tuple[int, int, int], float]:
        out = {}
        for replica in range(replicas):
            for stage, base in WELL.items():
                for tp_rank in range(tensor_parallel):
                    worker = (replica, stage, tp_rank)
                    noise = jitter.lognormvariate(0.0, 0.08) if jitter else 1.0
                    out[worker] = base * noise * slowed.get(worker, lambda _: 1.0)(step)
        return out

    return seconds_at


def from_step(first: int, factor: float):
    return lambda step: factor if step >= first else 1.0


def test_own_compute_counts_only_the_compute_ops_of_each_worker():
    events = timeline({(0, 1, 0): 0.5, (1, 1, 0): 0.25})
    events.append(OpEvent(1, "W", 3, 5.0, 5.125, 1, chunk=1))
    events.append(OpEvent(1, "I", 3, 6.0, 6.125, 1))
    events.append(OpEvent(1, "gate", None, 0.0, 9.0, 1))
    assert own_compute(events) == {(0, 1, 0): 0.5, (1, 1, 0): 0.5}


def test_one_worker_slowed_2x_from_step_20_of_80_is_found_within_slow_steps():
    """The acceptance's run (p = 4, d = 2, replica 0's stage 2 at half speed from step 20): found
    at the 10th slow step, 29 (within slow_steps + 2), once, with its factor; nothing before."""
    found = run(80, pipeline(slowed={(0, 2, 0): from_step(20, 2.0)}))
    assert found == {29: (SlowWorker(0, 2, 0, 2.0),)}


def test_with_noise_the_slowed_worker_is_found_and_nothing_else_in_200_steps():
    """Seeded noise (8% per worker and step): no false positive over 200 unslowed steps, and the
    slowed worker is still found within slow_steps + 2 of its slowdown."""
    assert run(200, pipeline(jitter=random.Random(0))) == {}
    found = run(80, pipeline(slowed={(1, 3, 0): from_step(20, 2.0)}, jitter=random.Random(1)))
    assert list(found) == [29] and [worker.worker for worker in found[29]] == [(1, 3, 0)]
    assert 1.8 < found[29][0].factor < 2.2


def test_fewer_slow_steps_than_slow_steps_find_nothing():
    blip = lambda step: 2.0 if 20 <= step < 29 else 1.0  # 9 slow steps, then well
    assert run(80, pipeline(slowed={(0, 1, 0): blip})) == {}


def test_a_noisy_step_of_a_peer_or_another_stage_does_not_hide_a_slow_worker():
    """Replica 0's stage 1 at 2x from step 20; at step 24 its replica's stage 0 takes 1.5x (a noisy step: for
    that step alone the replica looks slowed alike), at step 25 the other replica's stage 1 takes 1.8x (for
    that step alone it is not behind its stage): the comparisons are of medians, and it is found at 29."""
    spikes = {(0, 0, 0): lambda step: 1.5 if step == 24 else 1.0, (1, 1, 0): lambda step: 1.8 if step == 25 else 1.0}
    found = run(60, pipeline(slowed={(0, 1, 0): from_step(20, 2.0), **spikes}))
    assert found == {29: (SlowWorker(0, 1, 0, 2.0),)}


def test_a_whole_replica_slowed_alike_names_no_worker():
    """A shared cause (the replica's node throttled): every stage of replica 1 at 1.5x."""
    slowed = {(1, stage, 0): from_step(20, 1.5) for stage in WELL}
    assert run(80, pipeline(slowed=slowed)) == {}


def test_a_stage_slowed_in_every_replica_names_no_worker():
    """The same stage slower in every replica (its work grew, e.g. longer sequences): not a worker's fault."""
    slowed = {(replica, 1, 0): from_step(20, 2.0) for replica in range(2)}
    assert run(80, pipeline(slowed=slowed)) == {}


def test_one_replica_is_compared_with_its_own_baseline_and_its_other_stages():
    """d = 1: no other replica to compare with; the baseline and the replica's other stages decide."""
    found = run(60, pipeline(replicas=1, slowed={(0, 0, 0): from_step(15, 1.5)}))
    assert found == {24: (SlowWorker(0, 0, 0, 1.5),)}
    assert run(60, pipeline(replicas=1, slowed={(0, 0, 0): from_step(15, 1.2)})) == {}  # below slow_factor


def test_a_slow_tensor_parallel_rank_is_blamed_not_its_waiting_peers():
    """t = 2: rank 1 of replica 0's stage 2 computes 2x. Its own compute stands out from its peer's and
    from the other replica's rank 1: it alone is named."""
    found = run(40, pipeline(slowed={(0, 2, 1): from_step(10, 2.0)}, tensor_parallel=2))
    assert found == {19: (SlowWorker(0, 2, 1, 2.0),)}


def test_tensor_parallel_peers_slowed_alike_are_not_blamed_by_name():
    """Where every rank of a stage shows the same slowdown (a rank's peers whose op times include their
    waits for it, or the stage's node throttled), no rank's own compute stands out: none is named."""
    slowed = {(0, 2, tp_rank): from_step(10, 2.0) for tp_rank in range(2)}
    assert run(40, pipeline(slowed=slowed, tensor_parallel=2)) == {}


def test_a_worker_is_reported_once_until_it_is_well_again():
    slow_twice = lambda step: 2.0 if 10 <= step < 30 or step >= 50 else 1.0
    found = run(80, pipeline(slowed={(0, 0, 0): slow_twice}))
    assert list(found) == [19, 59]


def test_slowdowns_are_each_workers_ratio_to_its_baseline():
    view = ComputeView(steps=({(0, 0, 0): 2.0, (0, 1, 0): 1.0},) * 2 + ({(0, 0, 0): 3.0, (0, 1, 0): 1.0},),
                       baselines={(0, 0, 0): 1.0, (0, 1, 0): 1.0}, slow_steps=3)
    assert slowdowns(view) == {(0, 0, 0): 2.0, (0, 1, 0): 1.0}
    assert find_slow(view) == (SlowWorker(0, 0, 0, 2.0),)
    assert find_slow(ComputeView(view.steps, view.baselines, slow_factor=2.5, slow_steps=3)) == ()


def test_a_cleared_history_forgets_steps_baselines_and_reports():
    history = ComputeHistory(slow_steps=2)
    for _ in range(3):
        history.record(timeline({(0, 0, 0): 1.0, (0, 1, 0): 1.0}))
    history.newly_slow([SlowWorker(0, 0, 0, 2.0)])
    history.clear()
    assert not history.steps and not history.baselines and not history.reported


def test_the_detection_is_pure():
    """No Ray, no I/O: the standard library, core's result types and its rank arithmetic."""
    allowed = {"__future__", "collections", "collections.abc", "dataclasses", "statistics", "types",
               "raypipe.core.result", "raypipe.core.topology"}
    tree = ast.parse(Path(stragglers.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert imported <= allowed, imported - allowed


@pytest.mark.parametrize("slow_steps", [1, 5])
def test_slow_steps_sets_how_long_a_worker_must_stay_behind(slow_steps):
    found = run(60, pipeline(slowed={(0, 1, 0): from_step(30, 2.0)}), slow_steps=slow_steps)
    assert list(found) == [30 + slow_steps - 1]


SLOW = (SlowWorker(1, 0, 0, 2.0), SlowWorker(0, 3, 0, 1.6))  # ranks 4 and 3 of 2 replicas x 4 stages


def slow_view(**facts) -> SlowView:
    return SlowView(**{"found": SLOW, "on_slow": "replace", "spares_up": 2, "num_stages": 4, "replicas": 2, **facts})


def test_on_slow_report_only_reports():
    assert decide_slow(slow_view(on_slow="report")) == ReportSlow("on_slow='report'")


def test_on_slow_replace_swaps_the_workers_found_slow_for_the_spares_up_in_rank_order():
    assert decide_slow(slow_view()) == ReplaceSlow((3, 4))
    assert decide_slow(slow_view(spares_up=1)) == ReplaceSlow((3,), left=(4,))  # one spare: the lower rank
    assert decide_slow(slow_view(spares_up=0)) == ReportSlow("no warm spare is up to take a slow worker's place")
    assert decide_slow(slow_view(found=())) == ReportSlow("no worker is slow")
    # ranks by the topology: replica-major, then stage, then tp_rank
    assert decide_slow(slow_view(found=(SlowWorker(1, 2, 1, 1.5),), tensor_parallel=2)) == ReplaceSlow((13,))


def test_no_false_positive_over_200_unslowed_steps_of_timed_layers_under_this_machines_noise():
    """The real step runner in one process (tests/reference.py's InterpretedTrainer, no Ray) on timed
    layers, 2 replicas x 2 stages: 200 steps of measured timelines, with this machine's noise (Python,
    autograd, sleep overshoot, other processes), find no worker slow."""
    import torch
    from torch import nn

    import raypipe
    from raypipe.testing import timed_model
    from tests.reference import InterpretedTrainer

    torch.manual_seed(0)
    layers = timed_model(4, forward_s=0.0005, input_grad_s=0.0005, weight_grad_s=0.0005, width=8)
    config = raypipe.PipelineConfig(num_stages=2, num_replicas=2, num_micro_batches=1)
    trainer = InterpretedTrainer(layers, nn.functional.mse_loss, lambda params: torch.optim.SGD(params, lr=0.01),
                                 config)
    inputs, targets = torch.randn(8, 8), torch.randn(8, 8)
    history, found = ComputeHistory(), []
    for step in range(200):
        history.record(trainer.step(inputs, targets).timeline)
        found += [(step, slow) for slow in find_slow(history.view())]
    assert found == []
    assert len(slowdowns(history.view())) == 4  # every worker measured
