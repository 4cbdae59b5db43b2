"""Slow workers found from their own compute, a pure decision on fabricated timelines (no Ray).

The rebalance (on_slow="rebalance"): the new partition for fabricated views, worked out by hand from
the rule in stragglers.py's docstring, and the stage-weighted split against every contiguous split; and
the rebalanced partition's arithmetic, its workers adopting the old ones' snapshots as the controller's
rebalance has them do, against the unslowed run on the configured partition.

Parity: each case is a step history written out by hand (the acceptance's p = 4, d = 2 with one
worker slowed 2x from step 20 of 80; a whole replica slowed; a tensor-parallel rank and its
waiting peers; one replica alone; a stage slowed in every replica), and the workers it must name,
with the step they are found at, worked out from the rule in raypipe/control/stragglers.py's
docstring; the decision after (report or replace); and one unslowed run of the real step runner in
one process, whose measured timelines under this machine's noise must name no worker."""
from __future__ import annotations

import ast
import dataclasses
import random
from pathlib import Path

import pytest

from raypipe.control import stragglers
from raypipe.control.stragglers import (REBALANCE_MARGIN, ComputeHistory, ComputeView, RebalanceSlow, ReplaceSlow,
                                        ReportSlow, SlowView, SlowWorker, decide_slow, find_slow, layer_seconds,
                                        own_compute, slowdowns, well_stage_seconds)
from raypipe.core.partition import min_max_partition, stage_layer_ranges
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


def test_own_compute_leaves_out_the_waits_in_tensor_parallel_collectives():
    """At t > 1 an op's time less its measured wait in the stage's collectives (a waiting peer's F is
    mostly wait); a step where a compute op's wait was not measured (sampled at other steps) has no
    known own compute."""
    events = [OpEvent(0, "F", 0, 1.0, 1.5, tp_rank=0, collective_wait=0.375),
              OpEvent(0, "B", 0, 2.0, 2.5, tp_rank=0, collective_wait=0.25),
              OpEvent(0, "F", 0, 1.0, 1.5, tp_rank=1, collective_wait=0.0),
              OpEvent(0, "recv", 0, 0.0, 1.0, tp_rank=1, collective_wait=None)]  # not a compute op: not read
    assert own_compute(events) == {(0, 0, 0): 0.375, (0, 0, 1): 0.5}
    events.append(OpEvent(0, "B", 1, 3.0, 3.5, tp_rank=1, collective_wait=None))
    assert own_compute(events) is None


def test_the_history_counts_only_the_steps_whose_own_compute_was_measured():
    """The steps sampled: slow_steps counts them, and those between leave the history as it was."""
    history = ComputeHistory(slow_steps=2)
    measured = timeline({(0, 0, 0): 1.0, (0, 0, 1): 1.0})
    unmeasured = [dataclasses.replace(event, collective_wait=None) for event in measured]
    for events in (measured, unmeasured, unmeasured, measured, unmeasured):
        history.record(events)
    assert len(history.steps) == 2 and history.baselines == {(0, 0, 0): 1.0, (0, 0, 1): 1.0}


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


def test_tensor_parallel_peers_slowed_alike_name_their_stage_whole():
    """Where every rank of a stage shows the same slowdown (a rank's peers whose op times include their
    waits for it, as on GPUs, or the stage's node throttled), no rank's own compute stands out: the
    stage is named whole, each of its ranks, against the other replica's same stage; with one replica,
    against its own baseline and the replica's other stages. A stage slowed alike in every replica
    still names none (test_a_stage_slowed_in_every_replica_names_no_worker)."""
    slowed = {(0, 2, tp_rank): from_step(10, 2.0) for tp_rank in range(2)}
    stage = (SlowWorker(0, 2, 0, 2.0), SlowWorker(0, 2, 1, 2.0))
    assert run(40, pipeline(slowed=slowed, tensor_parallel=2)) == {19: stage}
    assert run(40, pipeline(replicas=1, slowed=slowed, tensor_parallel=2)) == {19: stage}
    # one rank standing out of its behind peers is named alone, not its stage
    slowed[(0, 2, 1)] = from_step(10, 3.0)
    assert run(40, pipeline(slowed=slowed, tensor_parallel=2)) == {19: (SlowWorker(0, 2, 1, 3.0),)}
    # every replica's stage 2 slowed alike: a cause they share, no stage named
    slowed = {(replica, 2, tp_rank): from_step(10, 2.0) for replica in range(2) for tp_rank in range(2)}
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
               "raypipe.core.partition", "raypipe.core.result", "raypipe.core.topology"}
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
    # at t > 1 a spare is a group of t on one node: it takes the whole stage of a rank found slow (ranks by
    # the topology: replica-major, then stage, then tp_rank), stage by stage as spare groups are up
    assert decide_slow(slow_view(found=(SlowWorker(1, 2, 1, 1.5),), tensor_parallel=2)) == ReplaceSlow((12, 13))
    both = (SlowWorker(0, 1, 0, 2.0), SlowWorker(0, 1, 1, 2.0), SlowWorker(1, 2, 1, 1.5))
    assert decide_slow(slow_view(found=both, tensor_parallel=2, spares_up=1)) == ReplaceSlow((2, 3), left=(12, 13))


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


def rebalance_view(**facts) -> SlowView:
    """The acceptance's rebalance (p = 4, d = 2, 16 equal layers, replica 0's stage 2 found 2x slow), each stage
    1 s a step when well (a layer 0.25 s: sums exact in binary, so the split's ties are the rule's, not rounding's)."""
    return SlowView(**{"found": (SlowWorker(0, 2, 0, 2.0),), "on_slow": "rebalance", "spares_up": 0, "num_stages": 4,
                       "replicas": 2, "balance": (4, 4, 4, 4), "stage_seconds": (1.0,) * 4,
                       "layer_costs": (1.0,) * 16, **facts})


def test_on_slow_rebalance_moves_layers_off_the_slow_stage_in_every_replica():
    """Stage 2 weighted 2x: 2 s. The best split at 4 stages gives it 2 layers (1 s) and the others 4, 5, 5
    (1.25 s: 3 layers on stage 2 would take 1.5 s): 2 -> 1.25 s, ties to earlier stages taking fewer."""
    decision = decide_slow(rebalance_view())
    assert decision == RebalanceSlow((4, 5, 2, 5), 2.0, 1.25, (SlowWorker(0, 2, 0, 2.0),))
    assert decide_slow(rebalance_view(on_slow="report")) == ReportSlow("on_slow='report'")
    assert decide_slow(rebalance_view(found=())) == ReportSlow("no worker is slow")  # e.g. a whole replica slowed


def test_a_stage_s_time_is_spread_over_its_layers_by_their_costs():
    """Stage 0 (1 s) holds layers of costs 1 and 3, stage 1 (1 s) two of cost 1: 0.25, 0.75, 0.5, 0.5 s. Stage 0
    2x slow: (2, 2) takes 2 s, (1, 3) 1.75 s (0.5 on stage 0), (3, 1) 3 s: (1, 3), 12.5% faster."""
    assert layer_seconds((2, 2), (1.0, 1.0), (1.0, 3.0, 1.0, 1.0)) == [0.25, 0.75, 0.5, 0.5]
    assert layer_seconds((1, 1), (1.0, 2.0), (0.0, 0.0)) == [1.0, 2.0]  # no costs: equal shares
    view = rebalance_view(found=(SlowWorker(1, 0, 0, 2.0),), num_stages=2, balance=(2, 2), stage_seconds=(1.0, 1.0),
                          layer_costs=(1.0, 3.0, 1.0, 1.0))
    assert decide_slow(view) == RebalanceSlow((1, 3), 2.0, 1.75, (SlowWorker(1, 0, 0, 2.0),))


def test_a_rebalance_that_gains_less_than_the_margin_is_not_taken():
    """1.04x on one of 4 stages of 4 layers: 1.04 s, and a layer moved off it leaves a stage of 5 (1.25 s)."""
    decision = decide_slow(rebalance_view(found=(SlowWorker(0, 1, 0, 1.04),)))
    assert isinstance(decision, ReportSlow) and f"by {REBALANCE_MARGIN:.0%}" in decision.why
    assert isinstance(decide_slow(rebalance_view(stage_seconds=(0.16, 0.0, 0.16, 0.16))), ReportSlow)  # unmeasured
    # at t > 1 the same split (a re-partition keeps t: each rank adopts its own tp_rank's parts)
    assert decide_slow(rebalance_view(tensor_parallel=2)) == decide_slow(rebalance_view())


def test_slow_workers_in_two_replicas_weight_their_stages_alike():
    """Replica 0's stage 0 and replica 1's stage 3 each 2x: the one partition for both replicas moves
    layers off both ends (a stage is as slow as its slowest copy). 1.25 s would need at most 2 layers on
    each end and 5 on each middle stage (14 < 16): 1.5 s, (2, 5, 6, 3)."""
    decision = decide_slow(rebalance_view(found=(SlowWorker(0, 0, 0, 2.0), SlowWorker(1, 3, 0, 2.0))))
    assert (decision.balance, decision.after) == ((2, 5, 6, 3), 1.5)


def test_a_worker_rebalanced_for_keeps_its_slowdown_in_a_later_rebalance():
    """After the rebalance to (4, 5, 2, 5) for replica 0's stage 2 (2x), its baseline is its slow pace on its 2
    layers (1 s, against replica 1's 0.5): its stage's time when well is that over its 2x. Replica 1's stage 0
    found 2x later weights stage 0, and stage 2 keeps its 2x: 1.25 s would need at most 2 layers on each and 5
    on the others (14 < 16), so 1.5 s, (2, 5, 3, 6)."""
    rebalanced = (SlowWorker(0, 2, 0, 2.0),)
    baselines = {(0, 0, 0): 1.0, (0, 1, 0): 1.25, (0, 2, 0): 1.0, (0, 3, 0): 1.25,
                 (1, 0, 0): 1.0, (1, 1, 0): 1.25, (1, 2, 0): 0.5, (1, 3, 0): 1.25}
    seconds = well_stage_seconds(baselines, 4, rebalanced)
    assert seconds == (1.0, 1.25, 0.5, 1.25)
    view = rebalance_view(found=(SlowWorker(1, 0, 0, 2.0),), balance=(4, 5, 2, 5), stage_seconds=seconds,
                          rebalanced=rebalanced)
    decision = decide_slow(view)
    assert decision == RebalanceSlow((2, 5, 3, 6), 2.0, 1.5, (SlowWorker(0, 2, 0, 2.0), SlowWorker(1, 0, 0, 2.0)))
    again = decide_slow(dataclasses.replace(view, found=(SlowWorker(0, 2, 0, 1.5),)))  # slowed further: multiplied
    assert again.slowed == (SlowWorker(0, 2, 0, 3.0),)


@pytest.mark.parametrize("seed", range(20))
def test_the_stage_weighted_split_is_the_best_contiguous_one(seed):
    """Against every contiguous split (a brute force over the cuts): the smallest slowest weighted stage."""
    import itertools

    generator = random.Random(seed)
    layers, stages = generator.randint(3, 9), generator.randint(1, 3)
    times = [generator.uniform(0.1, 1.0) for _ in range(layers)]
    weights = [generator.choice([1.0, 1.0, 1.5, 2.0, 3.0]) for _ in range(stages)]

    def slowest(balance) -> float:
        return max(weight * sum(times[index] for index in layers_of)
                   for layers_of, weight in zip(stage_layer_ranges(balance), weights))

    best = min(slowest([b - a for a, b in zip((0, *cuts), (*cuts, layers))])
               for cuts in itertools.combinations(range(1, layers), stages - 1))
    assert slowest(min_max_partition(times, stages, stage_weights=weights)) == pytest.approx(best, rel=1e-12)


def test_the_rebalanced_partition_trains_as_the_unslowed_run_within_1e_5():
    """p = 4, d = 2, 16 timed layers (no sleeps), Adam: 6 steps on (4, 4, 4, 4), then the workers of the
    partition the decision above takes, (4, 5, 2, 5), adopt the old workers' snapshots (each those holding
    its layers: what the controller's rebalance has each new worker do) and run 6 more. Every loss and every
    weight at the end is the unslowed run's on (4, 4, 4, 4), within 1e-5. (The steps are few for the suite's
    time: the partition's arithmetic does not change with the step.)"""
    import copy
    import pickle

    import torch
    from torch import nn

    import raypipe
    from raypipe.control.snapshots import holding
    from raypipe.testing import timed_model
    from tests.reference import InterpretedTrainer

    torch.manual_seed(0)
    layers = timed_model(16, 0.0, 0.0, 0.0, width=8)
    config = raypipe.PipelineConfig(num_stages=4, num_replicas=2, num_micro_batches=2, balance=[4, 4, 4, 4])
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)) for _ in range(12)]

    def trainer(balance):
        return InterpretedTrainer(copy.deepcopy(layers), nn.functional.mse_loss,
                                  lambda params: torch.optim.Adam(params, lr=0.01), config.replace(balance=balance))

    unslowed = trainer([4, 4, 4, 4])
    expected = [unslowed.step(*batch).loss for batch in batches]
    before = trainer([4, 4, 4, 4])
    losses = [before.step(*batch).loss for batch in batches[:6]]
    balance = list(decide_slow(rebalance_view()).balance)
    assert balance == [4, 5, 2, 5]
    after = trainer(balance)
    # pickled, as the object store ships them: each worker unpickles its own copy (sharing no tensor with another)
    snapshots = [pickle.dumps(worker.snapshot()) for worker in before.pipeline.workers]
    held = [worker.layer_indices for worker in before.pipeline.workers]
    for worker in after.pipeline.workers:
        worker.adopt(*map(pickle.loads, holding(snapshots, held, worker.layer_indices)))
    after.step_count = before.step_count
    losses += [after.step(*batch).loss for batch in batches[6:]]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-7)
    state, reference = after.state_dict(), unslowed.state_dict()
    assert state.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(state[name], reference[name], rtol=1e-5, atol=1e-7)
