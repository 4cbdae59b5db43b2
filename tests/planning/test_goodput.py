"""The goodput model (no Ray): the paper's MTTF from a per-node rate, the Monte Carlo against the
closed forms, a warm spare's refill, the methods' order on realistic figures, and ``raypipe plan
--node-mtbf-hours``."""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from dataclasses import replace

import pytest

from raypipe.planning.goodput import (BENCH_SPARE_REFILL_DELAY_S, PAPER_NODE_MTBF_HOURS, GoodputAssumptions,
                                      RunShape, goodput_by_method, job_mttf_hours, keeper_snapshot_every,
                                      node_mtbf_from_job_mttf,
                                      replica_drop_goodput, replicas_per_node, simulate_replica_drop,
                                      straggler_goodput, young_interval_s)
from raypipe.planning.segment_model import segment_goodput, simulate_segments
from raypipe.planning.spare_availability import (block_failures_within, poisson_failures_within,
                                                 poisson_spare_ready_fraction, spare_mixed_recovery_s,
                                                 spare_ready_fraction)
from raypipe.planning.plan import KEEPER_HELD_SNAPSHOTS, main as plan_main


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
    # the keeper of the best (d=16 p=4, ZeRO-1, bf16): a snapshot of every worker holds one copy of the fp32 main
    # weights and AdamW's two moments (each worker its 1/16) and, of the weights a worker does not own, their bf16
    # compute copies (15 replicas' worth): 8.03e9 x (12 + 15 x 2) bytes, fetched through the driver's node's
    # 50 GB/s and stored at 10 GB/s: 40 s, so at 3.48 s a step snapshots at least 12 steps apart, not 1
    best, keeper = plan["candidates"][0], plan["snapshot_keeper"]
    assert (best["num_replicas"], best["num_stages"], best["shard_optimizer"], best["snapshot_every"]) == (16, 4, True, 1)
    parameters = sum(row["num_parameters"] for row in plan["stages"])
    assert parameters == pytest.approx(8.03e9, rel=1e-3)
    assert keeper["state_bytes"] == pytest.approx(parameters * (12 + 15 * 2), rel=1e-6)
    assert keeper["held_bytes"] == 2 * keeper["state_bytes"]
    assert keeper["copy_s"] == pytest.approx(keeper["state_bytes"] * (1 / 50e9 + 1 / 10e9))
    assert keeper["min_snapshot_every"] == math.ceil(keeper["copy_s"] / best["step_time_s"]) == 12
    assert "snapshot_every=12 (the keeper's copy of one snapshot 40.5 s: at least 12)" in (
        best["goodput"]["raypipe"]["note"])
    for item in plan["candidates"]:
        for result in item["goodput"].values():
            assert 0.9 < result["goodput"] <= 1 and result["closed_form"] == pytest.approx(result["goodput"], abs=0.01)
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--node-mtbf-hours", "1011"]) == 0
    text = capsys.readouterr().out
    assert "goodput with node MTBF 1,011 h" in text and "full restart from a checkpoint" in text
    assert ("each copied in 40.5 s: a new snapshot waits for it, so snapshots are at least 12 steps apart, not 1, "
            "and a lost node redoes up to 11 steps") in text
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--node-mtbf-hours", "0"]) == 2
    assert capsys.readouterr().err.startswith("raypipe plan: error: --node-mtbf-hours must be")


def test_a_persistent_straggler_by_hand_and_in_the_plan(capsys):
    # 128 nodes, each 2x slow with probability 1%: some node is slow in 1 - 0.99^128 = 72.4% of runs, which then
    # go at half pace under on_slow="report"; "replace" pays each of the 1.28 expected slow nodes once: 10 slow
    # steps (8 s each, 8 s extra each) and a swap (detection + a spare's start + 20 GB at 50 GB/s) in a day
    shape, assumptions = _shape_70b_1024(), GoodputAssumptions()
    result = straggler_goodput(shape, assumptions, 0.01, 2.0)
    any_slow = 1 - 0.99 ** 128
    assert result["report"] == pytest.approx(1 - any_slow + any_slow / 2)
    swap = assumptions.detection_s + assumptions.replacement_with_spare_s + 20e9 / 50e9
    lost = 1.28 * (10 * 8.0 + swap)
    assert result["replace"] == pytest.approx(86400 / (86400 + lost))
    # "rebalance": the same 10 slow steps and a restart of every worker (no spare) per slow node, then the 8 stages
    # of 16 a slow node holds keep half their work each: (16 - 8 + 8 / 2) / 16 = 3/4 of the pace while one is slow
    restart = assumptions.detection_s + assumptions.replacement_without_spare_s + 20e9 / 50e9
    lost = 1.28 * (10 * 8.0 + restart)
    assert result["rebalance"] == pytest.approx((1 - any_slow + any_slow * 0.75) * 86400 / (86400 + lost))
    assert straggler_goodput(shape, assumptions, 0.01, 2.0, can_rebalance=False)["rebalance"] is None  # t > 1, v > 1
    assert straggler_goodput(replace(shape, num_stages=4), assumptions, 0.01, 2.0)["rebalance"] == pytest.approx(
        result["report"] * 86400 / (86400 + lost))  # a node holds whole replicas: slowed alike, no worker blamed
    assert straggler_goodput(shape, assumptions, 0.0, 2.0) == {"report": 1.0, "replace": 1.0, "rebalance": 1.0}
    with pytest.raises(ValueError, match="slow_factor=0.5 must be >= 1"):
        straggler_goodput(shape, assumptions, 0.01, 0.5)
    argv = ["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--node-mtbf-hours", "1011", "--top", "1"]
    assert plan_main([*argv, "--slow-node-share", "0.02", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["goodput_model"]["straggler"] == {"slow_node_share": 0.02, "slow_node_factor": 2.0}
    straggling = plan["candidates"][0]["straggler_goodput"]
    assert 0.5 < straggling["report"] < straggling["replace"] < 1
    assert plan_main([*argv, "--slow-node-share", "0.02", "--slow-node-factor", "1.5"]) == 0
    text = capsys.readouterr().out
    assert "0.02 of nodes 1.5x slow, on_slow=report" in text and "on_slow=rebalance" in text
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--slow-node-share", "0.1"]) == 2
    assert capsys.readouterr().err.startswith("raypipe plan: error: --slow-node-share adds rows to the goodput table")


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

    # the keeper: 1.1 TB of snapshots a copy, 100 s of it (12.5 steps of 7.7 s): a snapshot every 10 steps asked
    # is one every 13, and the heal from a snapshot loads all 1.1 TB from the keeper's node through its 50 GB/s
    kept = replace(shape, shard_optimizer=True, keeper_state_bytes=1.1e12, keeper_copy_s=100.0)
    assert keeper_snapshot_every(kept) == 13
    bounded = goodput_by_method(kept, assumptions)["raypipe_warm_spare"]
    recovery = assumptions.detection_s + assumptions.replacement_with_spare_s + 1.1e12 / 50e9
    first_order = 1 - (13 * 7.7 / 2 + 0.3 / 2 + recovery) / mttf - 0.3 / (13 * 7.7 + 0.3)
    assert bounded.closed_form == pytest.approx(first_order, abs=2e-4)
    assert bounded.save_interval_s == pytest.approx(13 * 7.7)
    assert "snapshot_every=13 (the keeper's copy of one snapshot 100 s: at least 13), transfer 22 s" in bounded.note
    # a sibling's heal loads nothing from the keeper (the cadence still waits for it); dropping a replica neither
    from_sibling = goodput_by_method(replace(kept, shard_optimizer=False), assumptions)
    assert from_sibling["raypipe_warm_spare"].note.startswith("from a sibling, snapshot_every=13 ")
    assert from_sibling["raypipe"].downtime_per_failure_s == pytest.approx(
        assumptions.detection_s + assumptions.replacement_without_spare_s + 20e9 / 50e9)
    assert (goodput_by_method(kept, assumptions)["replica_drop"].downtime_per_failure_s
            == goodput_by_method(replace(kept, keeper_copy_s=0.0, keeper_state_bytes=0.0),
                                 assumptions)["replica_drop"].downtime_per_failure_s)


def test_the_keepers_snapshots_are_the_runtimes():
    # the planner stays free of Ray, so it keeps its own copy of snapshot_keeper.py's KEPT_SNAPSHOTS
    source = (Path(__file__).parents[2] / "raypipe" / "runtime" / "snapshot_keeper.py").read_text()
    assert int(re.search(r"^KEPT_SNAPSHOTS = (\d+)", source, re.M).group(1)) == KEEPER_HELD_SNAPSHOTS


# bench_goodput's tiny LLaMA: a spare's recovery and a started process's (detection + replacement)
WITH_SPARE, WITHOUT_SPARE = 0.506, 5.896


def test_a_spare_is_always_up_without_a_refill_and_never_with_an_endless_one():
    for within in (poisson_failures_within(1 / 6.0), block_failures_within(6.0)):  # a failure every 6 s
        assert spare_ready_fraction(0.0, within, WITHOUT_SPARE) == 1.0
        # a refill far longer than the failures' interval: the failures within it (each 6 s of clock
        # and a recovery without a spare apart) find none, all but one in 1 + T / (6 + R)
        for replenish in (600.0, 3000.0):
            ready = spare_ready_fraction(replenish, within, WITHOUT_SPARE)
            assert ready == pytest.approx(1 / (1 + replenish / (6.0 + WITHOUT_SPARE)), rel=0.03)
        assert spare_ready_fraction(600.0, within) == pytest.approx(1 / (1 + 600 / 6.0), rel=0.03)
    endless = spare_ready_fraction(1e5, block_failures_within(6.0), WITHOUT_SPARE)
    assert spare_mixed_recovery_s(endless, WITH_SPARE, WITHOUT_SPARE) == pytest.approx(WITHOUT_SPARE, rel=1e-3)
    # the scale model: no refill time is the old model (the same closed form, and the same Monte Carlo
    # where no failure strikes a recovery); an endless one is raypipe's without spares
    shape = _shape_70b_1024()
    results = goodput_by_method(shape, GoodputAssumptions(spare_replenish_s=0.0))
    assumptions = GoodputAssumptions()
    recovery = assumptions.detection_s + assumptions.replacement_with_spare_s + 20e9 / 50e9
    assert results["raypipe_warm_spare"].downtime_per_failure_s == pytest.approx(recovery, rel=1e-3)
    assert simulate_segments(1.0, 1.0, 0.5, 0.2, 500.0, random.Random(3), False, 6.0, 0.0) == \
        simulate_segments(1.0, 1.0, 0.5, 0.2, 500.0, random.Random(3), False)
    endless = goodput_by_method(shape, GoodputAssumptions(spare_replenish_s=1e9))
    assert endless["raypipe_warm_spare"].closed_form == pytest.approx(endless["raypipe"].closed_form, abs=1e-7)
    assert endless["raypipe_warm_spare"].goodput == pytest.approx(endless["raypipe"].goodput, abs=1e-7)


def test_poisson_ready_share_is_erlangs_loss_formula():
    # one spare refilled T after each use: a failure finds it with chance 1 / (1 + l T), not exp(-l T)
    # (a failure that finds none does not restart the refill)
    for rate, replenish in ((1 / 20, 7.0), (1 / 6.28, 7.0), (2.0, 30.0)):
        erlang = 1 / (1 + rate * replenish)
        assert spare_ready_fraction(replenish, poisson_failures_within(rate)) == pytest.approx(erlang)
        erlang = 1 / (1 + rate * (replenish + 0.5))  # the clock running: the spare's own recovery too
        assert poisson_spare_ready_fraction(rate, replenish, 0.5, 6.0) == pytest.approx(erlang)
    # the failure clock stopped in recoveries: a miss's recovery (6 s) lets the refill go on, so fewer misses
    stopped = poisson_spare_ready_fraction(1 / 6.28, 7.0, WITH_SPARE, WITHOUT_SPARE, failures_during_recovery=False)
    assert 1 / (1 + 7.0 / 6.28) < stopped < 1 / (2 - math.exp(-7.0 / 6.28))
    # at real rates (a job MTTF of 7.9 h) the spare is back for all but ~3e-4 of failures
    mttf = 7.9 * 3600
    assert poisson_spare_ready_fraction(1 / mttf, 7.0, 1.0, 6.0) == pytest.approx(1 - 8.0 / mttf, abs=1e-7)


def test_spare_refill_closed_form_against_the_monte_carlo():
    step = 0.314
    for rate, replenish in ((1 / 6.28, 7.0), (1 / 20, 7.0), (1 / 5, 3.0)):
        # the failure clock stopped in recoveries (bench_goodput's kills): the mean recovery is exact
        ready = poisson_spare_ready_fraction(rate, replenish, WITH_SPARE, WITHOUT_SPARE, failures_during_recovery=False)
        closed = segment_goodput(step, step, spare_mixed_recovery_s(ready, WITH_SPARE, WITHOUT_SPARE), rate,
                                 failures_during_recovery=False)
        simulated, failures = simulate_segments(step, step, WITH_SPARE, rate, 20000 / rate, random.Random(0), False,
                                                WITHOUT_SPARE, replenish)
        assert failures > 15000
        assert simulated == pytest.approx(closed, abs=0.003)
    for rate, replenish, tolerance in ((1 / 20, 7.0, 0.006), (1 / 100, 7.0, 0.002)):
        # the clock running in recoveries: failures during one find the spare gone or back, which the
        # mean recovery in exp(l R) does not see, so they agree to first order in l R (not at l R ~ 1)
        ready = poisson_spare_ready_fraction(rate, replenish, WITH_SPARE, WITHOUT_SPARE)
        closed = segment_goodput(step, step, spare_mixed_recovery_s(ready, WITH_SPARE, WITHOUT_SPARE), rate)
        simulated, _ = simulate_segments(step, step, WITH_SPARE, rate, 20000 / rate, random.Random(0),
                                         recovery_without_spare_s=WITHOUT_SPARE, spare_replenish_s=replenish)
        assert simulated == pytest.approx(closed, abs=tolerance)
    # at real rates the two agree as closely as without spares
    for result in goodput_by_method(_shape_70b_1024(), GoodputAssumptions(node_mtbf_hours=20.0)).values():
        assert result.goodput == pytest.approx(result.closed_form, abs=0.01)


def test_bench_kills_triangular_interval_against_sampling():
    # bench_goodput --every-steps: one kill per block at a uniform moment; the interval between kills
    # is triangular on [0, 2a], P(X >= t) = 1 - t^2/(2a^2) below a, (2a - t)^2/(2a^2) above
    block = 6.28
    within = block_failures_within(block)
    for t in (0.0, 1.0, 3.0, 6.28, 7.0, 10.0, 12.56, 13.0):
        exceeds = 1 - t ** 2 / (2 * block ** 2) if t <= block else max(0.0, 2 * block - t) ** 2 / (2 * block ** 2)
        assert 1 - within(1, t) == pytest.approx(exceeds)
    rng = random.Random(7)
    moments = [(block_index + rng.random()) * block for block_index in range(100_001)]
    for k in (1, 2):
        gaps = [later - earlier for earlier, later in zip(moments, moments[k:])]
        for t in (3.0, 7.0, 11.0, 15.0):
            sampled = sum(gap < t for gap in gaps) / len(gaps)
            assert sampled == pytest.approx(within(k, t), abs=0.006)
    # bench_goodput's K = 20 (314 ms steps) with a 7 s refill: 62% of kills find a spare (a simulation of
    # its own kill schedule reads 60-62%), and the prediction moves from 0.902 to 0.694 (measured 0.723)
    ready = spare_ready_fraction(7.0, within, WITHOUT_SPARE)
    assert ready == pytest.approx(0.622, abs=0.001)
    assert segment_goodput(0.314, 0.314, spare_mixed_recovery_s(ready, WITH_SPARE, WITHOUT_SPARE), 1 / block,
                           failures_during_recovery=False) == pytest.approx(0.694, abs=0.001)


def test_spare_refill_delay_is_the_pools():
    # the goodput model stays free of Ray, so it keeps its own copy of spares.py's REFILL_DELAY_S
    source = (Path(__file__).parents[2] / "raypipe" / "runtime" / "spares.py").read_text()
    assert float(re.search(r"^REFILL_DELAY_S = ([0-9.]+)", source, re.M).group(1)) == BENCH_SPARE_REFILL_DELAY_S
