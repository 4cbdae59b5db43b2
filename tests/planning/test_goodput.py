"""The goodput model (no Ray): the paper's MTTF from a per-node rate, the Monte Carlo against the
closed forms, the methods' order on realistic figures, and ``raypipe plan --node-mtbf-hours``."""
from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from raypipe.planning.goodput import (PAPER_NODE_MTBF_HOURS, GoodputAssumptions, RunShape, goodput_by_method,
                                      job_mttf_hours, node_mtbf_from_job_mttf, replica_drop_goodput,
                                      replicas_per_node, segment_goodput, simulate_replica_drop,
                                      simulate_segments, young_interval_s)
from raypipe.planning.plan import main as plan_main


def test_paper_mttf_round_trip_and_first_failure_of_128_nodes():
    # arXiv 2410.21680: 7.9 h at 1,024 GPUs = 128 nodes of 8 -> ~1011 h per node, and back
    assert node_mtbf_from_job_mttf(7.9, 1024) == pytest.approx(1011.2)
    assert PAPER_NODE_MTBF_HOURS == pytest.approx(1011.2)
    assert job_mttf_hours(1024, PAPER_NODE_MTBF_HOURS) == pytest.approx(7.9)
    assert job_mttf_hours(16384, PAPER_NODE_MTBF_HOURS) == pytest.approx(7.9 / 16)
    # independent of the formula: the first failure among 128 nodes, each an exponential of mean H
    rng = random.Random(1)
    firsts = [min(rng.expovariate(1 / PAPER_NODE_MTBF_HOURS) for _ in range(128)) for _ in range(4000)]
    assert sum(firsts) / len(firsts) == pytest.approx(7.9, rel=0.05)


def test_segment_closed_form_by_hand_and_against_the_monte_carlo():
    # R = 0, rate 1, a segment of 1: expected wall (e - 1), the textbook restart-on-failure time
    assert segment_goodput(1.0, 1.0, 0.0, 1.0) == pytest.approx(1 / (math.e - 1))
    for work, segment, recovery, rate in ((1.0, 1.0, 0.5, 0.3), (4.0, 4.5, 2.0, 0.05), (0.3, 0.3, 3.5, 1 / 20)):
        closed = segment_goodput(work, segment, recovery, rate)
        simulated, failures = simulate_segments(work, segment, recovery, rate, 3000 / rate, random.Random(0))
        assert failures > 2000
        assert simulated == pytest.approx(closed, abs=0.01)
        # the failure clock stopped during recoveries (bench_goodput's kills): E[X] = (e^lT - 1)(1/l + R)
        paused = segment_goodput(work, segment, recovery, rate, failures_during_recovery=False)
        assert paused == pytest.approx(work * rate / (math.expm1(rate * segment) * (1 + rate * recovery)))
        simulated, _ = simulate_segments(work, segment, recovery, rate, 3000 / rate, random.Random(0),
                                         failures_during_recovery=False)
        assert simulated == pytest.approx(paused, abs=0.01)


def test_young_interval_matches_the_first_order_waste():
    # checkpoint C = 10 s, M = 7.9 h: tau = sqrt(2 C M); goodput ~ 1 - C/tau - (tau/2 + R)/M to first order
    mttf, write, restart = 7.9 * 3600, 10.0, 300.0
    tau = young_interval_s(write, mttf)
    assert tau == pytest.approx(754.0, abs=1)
    first_order = 1 - write / tau - (tau / 2 + restart) / mttf
    assert segment_goodput(tau, tau + write, restart, 1 / mttf) == pytest.approx(first_order, abs=0.002)
    # and tau is the best interval of the exact form (within the flat optimum's tolerance)
    best = max(segment_goodput(t, t + write, restart, 1 / mttf) for t in range(100, 3000, 10))
    assert segment_goodput(tau, tau + write, restart, 1 / mttf) == pytest.approx(best, abs=5e-4)


def test_replica_drop_monte_carlo_against_first_order():
    assert replicas_per_node(4, 2, 8) == [4]  # p=2: 4 replicas on one node
    assert replicas_per_node(2, 16, 8) == [1, 1, 1, 1]
    assert replicas_per_node(3, 3, 8) == [3, 1]  # 9 GPUs: replica 2 on GPUs 6-8, across both nodes
    step, rejoin, detect, rate = 2.0, 5.0, 0.5, 1 / 200
    hits = replicas_per_node(16, 4, 8)  # 2 replicas per node, 8 nodes
    simulated, failures = simulate_replica_drop(step, rejoin, detect, rate, 16, hits, 4, 8, 3000 / rate,
                                                random.Random(0))
    # by hand: 1 - 0.5/200 - 2 x (2 + 5) / 16 / 200 = 1 - 0.0025 - 0.004375
    assert replica_drop_goodput(step, rejoin, detect, rate, 16, 2) == pytest.approx(0.993125)
    assert failures > 2000
    assert simulated == pytest.approx(0.993125, abs=0.002)


def _shape_70b_1024() -> RunShape:
    # a 70B on 1,024 H100s as the plan predicts it (8 s steps, ~20 GB per worker, 1.1 TB of state)
    return RunShape(num_gpus=1024, num_replicas=64, num_stages=16, step_s=8.0, snapshot_exposed_s=0.3,
                    largest_worker_state_bytes=20e9, model_state_bytes=70e9 * 16, inter_node_bytes_per_s=50e9)


def test_methods_order_on_realistic_figures():
    for gpus, replicas in ((1024, 64), (16384, 1024)):
        shape = replace(_shape_70b_1024(), num_gpus=gpus, num_replicas=replicas)
        results = goodput_by_method(shape, GoodputAssumptions())
        closed = {method: result.closed_form for method, result in results.items()}
        assert closed["raypipe_warm_spare"] > closed["raypipe"] > closed["checkpoint_restart"]
        assert results["raypipe"].goodput > results["checkpoint_restart"].goodput
        for result in results.values():
            assert result.goodput == pytest.approx(result.closed_form, abs=0.01)
    one = goodput_by_method(replace(_shape_70b_1024(), num_replicas=1, num_gpus=16), GoodputAssumptions())
    assert one["replica_drop"].goodput is None


def test_assumptions_reject_bad_values():
    with pytest.raises(ValueError, match="node_mtbf_hours"):
        GoodputAssumptions(node_mtbf_hours=0)
    with pytest.raises(ValueError, match="snapshot_every"):
        GoodputAssumptions(snapshot_every=0)


def test_plan_node_mtbf_hours_adds_goodput(capsys):
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--node-mtbf-hours", "1011",
                      "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tokens_per_second", "mfu", "bubble_fraction", "candidates", "stages", "balances"):
        assert key in plan
    assert set(plan["goodput"]) == {"raypipe_warm_spare", "raypipe", "checkpoint_restart", "replica_drop"}
    assert plan["goodput_model"]["job_mttf_hours"] == pytest.approx(1011 / 8)
    for item in plan["candidates"]:
        for result in item["goodput"].values():
            assert 0.9 < result["goodput"] <= 1 and result["closed_form"] == pytest.approx(result["goodput"], abs=0.01)
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--node-mtbf-hours", "1011"]) == 0
    text = capsys.readouterr().out
    assert "goodput with node MTBF 1,011 h" in text and "full restart from a checkpoint" in text
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--node-mtbf-hours", "0"]) == 2
    assert capsys.readouterr().err.startswith("raypipe plan: error: --node-mtbf-hours must be")


def test_raypipe_heals_from_a_sibling_or_redoes_the_steps_since_its_snapshot():
    # d=64 without ZeRO-1: a sibling holds each lost stage, only the partial step is lost (S/2 + R
    # per failure to first order) and the snapshot's 0.3 s is spread over snapshot_every steps
    assumptions = GoodputAssumptions(snapshot_every=10)
    shape = _shape_70b_1024()
    mttf = 7.9 * 3600
    recovery = assumptions.detection_s + assumptions.replacement_with_spare_s + 20e9 / 50e9
    first_order = 1 - (7.7 / 2 + recovery) / mttf - 0.3 / 10 / 7.7
    sibling = goodput_by_method(shape, assumptions)["raypipe_warm_spare"]
    assert sibling.closed_form == pytest.approx(first_order, abs=2e-4)
    assert "from a sibling" in sibling.note
    # with ZeRO-1 the replicas differ: the 10 steps since the snapshot are redone (5 on average)
    sharded = goodput_by_method(replace(shape, shard_optimizer=True), assumptions)["raypipe_warm_spare"]
    first_order = 1 - (77.3 / 2 + recovery) / mttf - 0.3 / 77
    assert sharded.closed_form == pytest.approx(first_order, abs=2e-4)
