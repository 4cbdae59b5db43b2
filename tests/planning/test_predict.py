"""The step-time predictor and `raypipe plan --cluster` (no Ray): hand-checked steps, MFU,
the search against brute force, the cluster files and the plan's output."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from raypipe.models.layers import LayerCost
from raypipe.models.llama import LlamaConfig, get_config
from raypipe.models.llama_costs import llama_layer_costs
from raypipe.planning.balance import balance_by_time, llama_stage_bytes
from raypipe.planning.cluster_spec import Cluster, Link, load_cluster
from raypipe.planning.configuration_search import (LlamaStageBytes, candidate_shapes, search_plans,
                                                   snapshot_cadence)
from raypipe.planning.memory import estimate_stage
from raypipe.planning.plan import main as plan_main
from raypipe.planning.plan import run_commands, run_shape
from raypipe.planning.predict import StepShape, optimistic_step_s, predict_split, predict_step, stage_bounds
from raypipe.planning.tensor_parallel_collectives import llama_layer_collectives

GB = 10**9


def unit_cluster(**changes) -> Cluster:
    """1 TFLOP/s reached in full, 8 GB/s links without latency, 60 GB/s memory, 8 GB/s host copies."""
    cluster = Cluster(name="unit", peak_flops={"bf16": 1e12, "fp32": 1e12}, memory_bytes=10**15,
                      memory_bandwidth_bytes_per_s=60e9, gpus_per_node=8, intra_node=Link(8e9, 0.0),
                      inter_node=Link(8e9, 0.0), host_copy_bytes_per_s=8e9, achievable_fraction=1.0)
    return replace(cluster, **changes)


# four layers of 1e9 parameters (2 GB of bf16 weights): 1 s forward, 2 s backward per sequence
LAYER = LayerCost(fwd_flops=1e12, bwd_input_flops=1e12, bwd_weight_flops=1e12, param_bytes=2 * GB)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_four_micro_batches_by_hand(schedule):
    # per stage F = 2 s, B = 4 s; p = 2, m = 4: the pipeline is (m + p - 1)(F + B) = 30 s. Two replicas
    # on one node: stage 0's 2e9 parameters' fp32 gradients (8 GB) ring-all-reduced, 2 (d-1)/d x 8 GB / 8 GB/s
    # = 1 s after its last backward (at 30 s); stage 1 finished 4 s earlier, so its reduction hides. The
    # optimizer: bf16 with fp32 main weights touches 2x8 + 2x4 + 4 + 2 = 30 B per parameter, 60 GB at 60 GB/s.
    prediction = predict_step([LAYER] * 4, unit_cluster(), num_replicas=2, num_stages=2, num_micro_batches=4,
                              schedule=schedule, seq_len=100, snapshot_every=0)
    assert prediction.balance == (2, 2)
    assert prediction.pipeline_s == pytest.approx(30.0)
    assert prediction.pipeline_bubble == pytest.approx(1 - 24 / 30)
    assert prediction.reduction_exposed_s == pytest.approx(1.0)
    assert prediction.optimizer_s == pytest.approx(1.0)
    assert prediction.step_s == pytest.approx(32.0)
    assert prediction.tokens_per_s == pytest.approx(2 * 4 * 100 / 32)
    # each GPU computes 4 x (2 + 4) = 24 s of the 32: MFU 0.75 at a fully reached peak
    assert prediction.mfu == pytest.approx(24 / 32)
    assert prediction.bubble_fraction == pytest.approx(1 - 24 / 32)


def test_zero1_and_snapshot_by_hand():
    # ZeRO-1: reduce-scatter half the all-reduce (0.5 s), the optimizer on half the parameters (0.5 s),
    # then an all-gather of half the 4 GB of bf16 weights (0.25 s): 30 + 0.5 + 0.5 + 0.25
    zero = predict_step([LAYER] * 4, unit_cluster(), num_replicas=2, num_stages=2, num_micro_batches=4,
                        schedule="gpipe", shard_optimizer=True, seq_len=100, snapshot_every=0)
    assert zero.step_s == pytest.approx(31.25)
    # snapshot of a stage without ZeRO-1: fp32 main weights and Adam moments (12 B/param, 24 GB), to the host
    # (8 GB/s: 3 s) from the stage's first wait (stage 0: its first gradient, at 8 s; stage 1: its first input,
    # at 0 s), then into the object store (10 GB/s: 2.4 s) beside what follows: done long before the decision
    # at 31 s, and before the next step's snapshot
    snap = predict_step([LAYER] * 4, unit_cluster(), num_replicas=2, num_stages=2, num_micro_batches=4,
                        schedule="gpipe", seq_len=100, snapshot_every=1)
    assert snap.snapshot_exposed_s == 0.0 and snap.step_s == pytest.approx(32.0)
    assert (snap.snapshot_commit_wait_s, snap.snapshot_busy_s) == (0.0, pytest.approx(5.4))
    # at 1 GB/s to the host (24 s) and 24 GB/s into the store (1 s): stage 0's copy runs from 8 to 32 s, 1 s
    # past the decision, and its commit waits for it (stage 1's, 0 to 24 s, hides); the store does not
    slow = unit_cluster(host_copy_bytes_per_s=1e9, object_store_bytes_per_s=24e9)
    snap = predict_step([LAYER] * 4, slow, num_replicas=2, num_stages=2, num_micro_batches=4,
                        schedule="gpipe", seq_len=100, snapshot_every=1)
    assert snap.snapshot_exposed_s == pytest.approx(1.0)
    assert snap.step_s == pytest.approx(33.0)
    every_third = predict_step([LAYER] * 4, slow, num_replicas=2, num_stages=2, num_micro_batches=4,
                               schedule="gpipe", seq_len=100, snapshot_every=3)
    assert every_third.step_s == pytest.approx(32.0 + 1.0 / 3)
    assert snap.snapshot_exposed_at(3) == pytest.approx(1.0 / 3) and snap.snapshot_exposed_at(0) == 0.0
    # at 8 GB/s to the host (3 s, hidden) but 0.5 GB/s into the store (48 s): a worker's next snapshot starts
    # once its store is done, so a snapshot every step stretches each step to the 51 s of one copy and store;
    # every second step, the 64 s of two steps hold them
    stored_slowly = unit_cluster(object_store_bytes_per_s=0.5e9)
    snap = predict_step([LAYER] * 4, stored_slowly, num_replicas=2, num_stages=2, num_micro_batches=4,
                        schedule="gpipe", seq_len=100, snapshot_every=1)
    assert snap.step_s == pytest.approx(51.0) and snap.snapshot_exposed_s == pytest.approx(19.0)
    assert snap.snapshot_exposed_at(2) == 0.0
    every_other = predict_step([LAYER] * 4, stored_slowly, num_replicas=2, num_stages=2, num_micro_batches=4,
                               schedule="gpipe", seq_len=100, snapshot_every=2)
    assert every_other.step_s == pytest.approx(32.0)


def test_the_search_snapshots_less_often_where_a_copy_every_step_would_cost_more_than_3_percent():
    # LLaMA-7B on 8 H100 stages at m = 8: a stage's copy to the host and store into the object store (1.35 s)
    # against a 0.6 s step: a snapshot every step stretches each step to the 1.35 s; every 4th, the 4 steps
    # between hold the store, and the copy ends before the decision
    costs = llama_layer_costs(get_config("llama-7b"), 4096, "bf16")
    shape = dict(num_stages=8, num_micro_batches=8, schedule="1f1b", precision="bf16", seq_len=4096)
    every_step = predict_step(costs, load_cluster("h100"), snapshot_every=1, **shape)
    without = predict_step(costs, load_cluster("h100"), snapshot_every=0, **shape)
    assert every_step.step_s / without.step_s > 2
    assert every_step.step_s == pytest.approx(every_step.snapshot_busy_s) and every_step.snapshot_commit_wait_s == 0
    cadence = snapshot_cadence(every_step)
    assert cadence == 4
    assert every_step.snapshot_exposed_at(cadence) <= 0.03 * without.step_s
    assert every_step.snapshot_exposed_at(cadence // 2) > 0.03 * without.step_s
    every_fourth = predict_step(costs, load_cluster("h100"), snapshot_every=4, **shape)
    assert every_fourth.step_s == pytest.approx(without.step_s)
    result = search_plans(get_config("llama-7b"), load_cluster("h100"), 8, top=5, tensor_parallel=1)
    assert any(candidate.shape.snapshot_every > 1 for candidate in result.best)
    for candidate in result.best:
        command = run_commands("llama-7b", candidate)
        k = candidate.shape.snapshot_every
        assert (f"--snapshot-every {k}" in command["job_command"]) == (k > 1)
        assert command["helm_values"]["training"].get("snapshotEvery", 1) == k
        # the goodput model picks its own cadence from a snapshot's cost taken as fixed: a snapshot every
        # step's, not what one costs at the candidate's cadence (where the steps between may hide it all)
        prediction, goodput_shape = candidate.prediction, run_shape(get_config("llama-7b"), candidate,
                                                                    load_cluster("h100"))
        assert goodput_shape.snapshot_exposed_s == pytest.approx(prediction.snapshot_exposed_at(1))
        assert goodput_shape.step_s == pytest.approx(prediction.step_s - prediction.snapshot_exposed_s
                                                     + prediction.snapshot_exposed_at(1))
        if k > 1:
            assert goodput_shape.snapshot_exposed_s > 0.03 * (prediction.step_s - prediction.snapshot_exposed_s)
    fixed = search_plans(get_config("llama-7b"), load_cluster("h100"), 8, top=5, snapshot_every=1)
    assert all(candidate.shape.snapshot_every == 1 for candidate in fixed.best)


def test_messages_and_recompute_by_hand():
    # one stage per node (gpus_per_node=1): each activation and gradient of 8 GB crosses the inter-node
    # link in 1 s + 0.5 s latency. GPipe, p = 2, m = 1: F0, message, F1, B1, message, B0 = 2 + 1.5 + 2 + 4 +
    # 1.5 + 4; recompute adds each stage's forward to its backward (+4 s)
    layer = replace(LAYER, output_bytes=8 * GB, param_bytes=0)
    cluster = unit_cluster(gpus_per_node=1, inter_node=Link(8e9, 0.5))
    plain = predict_step([layer] * 4, cluster, num_stages=2, num_micro_batches=1, schedule="gpipe", seq_len=1,
                         snapshot_every=0)
    assert plain.step_s == pytest.approx(15.0)
    recomputed = predict_step([layer] * 4, cluster, num_stages=2, num_micro_batches=1, schedule="gpipe",
                              activation_checkpoint="always", seq_len=1, snapshot_every=0)
    assert recomputed.step_s == pytest.approx(19.0)
    assert recomputed.mfu == pytest.approx(12 / (19 * 2))  # recompute is not model flops


@pytest.mark.parametrize("schedule, ops_per_micro_batch", [("gpipe", 2), ("zb_h1", 3)])
def test_calibrated_overheads_by_hand(schedule, ops_per_micro_batch):
    # op_overhead_s = 0.1 s around each compute op: GPipe's F = 2.1, B = 4.1 s, so the pipeline is
    # (m + p - 1)(F + B) = 5 x 6.2 = 31 s; the overhead is idle time, not compute. step_overhead_s
    # = 0.5 s once per step, after the optimizer (1 s, as above; one replica: no reduction).
    base = predict_step([LAYER] * 4, unit_cluster(), num_stages=2, num_micro_batches=4, schedule=schedule,
                        seq_len=100, snapshot_every=0)
    calibrated = predict_step([LAYER] * 4, unit_cluster(op_overhead_s=0.1, step_overhead_s=0.5), num_stages=2,
                              num_micro_batches=4, schedule=schedule, seq_len=100, snapshot_every=0)
    if schedule == "gpipe":
        assert base.step_s == pytest.approx(31.0)
        assert calibrated.pipeline_s == pytest.approx(31.0)
        assert calibrated.step_s == pytest.approx(32.5)
    assert calibrated.step_s > base.step_s + 0.5
    # each stage computes 4 x (2 + 4) = 24 s whatever the overheads: they only add bubble
    busy = 2 * 24
    assert calibrated.pipeline_bubble == pytest.approx(1 - busy / (2 * calibrated.pipeline_s))
    assert calibrated.bubble_fraction == pytest.approx(1 - busy / (2 * calibrated.step_s))
    # the overheads of the ops on the critical path: at least one stage's m x ops, at most all
    added = calibrated.pipeline_s - base.pipeline_s
    assert 0.1 * 4 * ops_per_micro_batch <= added + 1e-9 <= 0.1 * 2 * 4 * ops_per_micro_batch


def test_cluster_file_overheads(tmp_path):
    data = json.loads((load_cluster.__globals__["CLUSTERS_DIR"] / "h100.json").read_text())
    assert (load_cluster("h100").op_overhead_s, load_cluster("h100").step_overhead_s) == (0.0, 0.0)
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(data | {"op_overhead_s": 2e-4, "step_overhead_s": 0.01}))
    cluster = load_cluster(str(path))
    assert (cluster.op_overhead_s, cluster.step_overhead_s) == (2e-4, 0.01)
    path.write_text(json.dumps(data | {"step_overhead_s": -1}))
    with pytest.raises(ValueError, match="step_overhead_s=-1 must be a number >= 0"):
        load_cluster(str(path))


def test_mfu_of_one_busy_gpu_is_the_achievable_fraction():
    layer = replace(LAYER, param_bytes=0)
    prediction = predict_step([layer] * 3, unit_cluster(achievable_fraction=0.5), num_micro_batches=5,
                              seq_len=7, snapshot_every=0)
    assert prediction.step_s == pytest.approx(5 * 3 * 3 / 0.5)
    assert prediction.mfu == pytest.approx(0.5)
    assert prediction.tokens_per_s == pytest.approx(5 * 7 / prediction.step_s)


def test_fast_stage_bytes_are_the_memory_model():
    config = LlamaConfig(vocab_size=1000, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=128)
    for schedule in ("gpipe", "1f1b"):
        for recompute in ("never", "always", "except_last"):
            for sharded in (False, True):
                shape = StepShape(num_replicas=4, num_stages=3, num_micro_batches=5, schedule=schedule,
                                  activation_checkpoint=recompute, precision="bf16", shard_optimizer=sharded,
                                  micro_batch_size=2, seq_len=128)
                fast = LlamaStageBytes(config, shape)
                for stage, (start, end) in enumerate([(0, 2), (2, 5), (5, 8)]):
                    expected = estimate_stage(config, range(start, end), num_micro_batches=5, micro_batch_size=2,
                                              seq_len=128, precision="bf16", activation_checkpoint=recompute,
                                              schedule=schedule, stage_index=stage, num_stages=3,
                                              optimizer_shards=4 if sharded else 1).total_bytes
                    assert fast(stage, start, end) == expected, (schedule, recompute, sharded, stage)


@pytest.mark.parametrize("t", [1, 2])
def test_search_finds_the_best_fitting_configuration_of_a_brute_force(t):
    # at a fixed tensor-parallel degree (the search over several drops a shape that fits at t / 2: not exact)
    config = LlamaConfig(vocab_size=4000, dim=256, n_layers=6, n_heads=8, n_kv_heads=2, ffn_dim=640,
                         max_seq_len=512)
    cluster = unit_cluster(gpus_per_node=2, inter_node=Link(1e9, 1e-4), intra_node=Link(1e10, 1e-5))
    # a memory limit that rules out the small stage counts without ZeRO-1 and recompute
    limit = 60 * 10**6 // t
    result = search_plans(config, cluster, 8, precision="bf16", gpu_memory_bytes=limit, top=2, tensor_parallel=t)
    assert result.best, result.reason
    assert all(candidate.shape.tensor_parallel == t for candidate in result.best)
    costs = llama_layer_costs(config, 512, "bf16")
    collectives = llama_layer_collectives(config, 512, "bf16") if t > 1 else None
    best_tokens, fitting = 0.0, 0
    shapes = candidate_shapes(8, config.n_layers + 2, seq_len=512, precision="bf16", tensor_parallels=(t,))
    for shape in shapes:
        exact_bytes = llama_stage_bytes(config, shape.num_stages, num_micro_batches=shape.num_micro_batches,
                                        micro_batch_size=shape.micro_batch_size, seq_len=512, precision="bf16",
                                        activation_checkpoint=shape.activation_checkpoint, schedule=shape.schedule,
                                        optimizer_shards=shape.num_replicas if shape.shard_optimizer else 1,
                                        tensor_parallel=t)
        try:  # the fastest split within the limit (the time balance where it fits)
            split = balance_by_time(costs, shape.num_stages, activation_checkpoint=shape.activation_checkpoint,
                                    num_micro_batches=shape.num_micro_batches, stage_bytes=exact_bytes,
                                    memory_limit_bytes=limit)
        except ValueError:
            continue
        bounds = stage_bounds(split)  # one rank's parameters and memory (the memory model's) under the split
        parameters = [LlamaStageBytes(config, shape).parameters(start, end) for start, end in bounds]
        memory = [exact_bytes(stage, start, end) for stage, (start, end) in enumerate(bounds)]
        prediction = predict_split(costs, split, parameters, memory, limit, shape, cluster, collectives=collectives)
        assert prediction.fits
        fitting += 1
        best_tokens = max(best_tokens, prediction.tokens_per_s)
    assert 0 < fitting < len(shapes)  # the limit bites
    chosen = result.best[0]
    assert chosen.prediction.fits and max(chosen.prediction.stage_bytes) <= limit
    assert chosen.prediction.tokens_per_s == pytest.approx(best_tokens, rel=1e-9)
    assert result.best[1].prediction.tokens_per_s <= chosen.prediction.tokens_per_s


def test_405b_on_16384_gpus_finds_a_layout_that_fits():
    # its time (25 s of CPU on 2026-12-03 with the chunked schedules searched, 10.4 s without, 35.9 s
    # before that day's speed-up; the issue asks <= 60 s) is in benchmarks/RESULTS.md, not asserted here;
    # at t = 1 only: the search over t = 1, 2, 4, 8 takes ~4x as long (tests/planning/test_predict_tensor_parallel.py
    # searches t on the 70B)
    result = search_plans(get_config("llama3-405b"), load_cluster("h100"), 16384, tensor_parallel=1)
    assert result.best and all(candidate.prediction.fits for candidate in result.best)
    assert result.best[0].shape.num_stages * result.best[0].shape.num_replicas == 16384


def test_the_search_runs_with_the_cyclic_collector_off_and_leaves_it_on(collector_on, monkeypatch):
    # the search allocates millions of small objects and makes no reference cycle: the collector's
    # passes over them took ~40% of its CPU (raypipe/core/collector_paused.py)
    import gc

    from raypipe.planning import configuration_search

    on_at_each = []  # whether the collector was on, at each split the search balances
    real = configuration_search.fastest_split_within

    def recording(*args, **kwargs):
        on_at_each.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(configuration_search, "fastest_split_within", recording)
    result = search_plans(get_config("llama3-8b"), load_cluster("h100"), 8, tensor_parallel=1)
    assert gc.isenabled()
    assert result.best and on_at_each and not any(on_at_each)


def test_presets_and_a_users_cluster_file(tmp_path):
    h100, h200 = load_cluster("h100"), load_cluster("h200")
    assert h100.peak("bf16") == h200.peak("bf16") == 989e12
    assert (h100.memory_bytes, h200.memory_bytes) == (80 * GB, 141 * GB)
    assert h100.inter_node.bandwidth_bytes_per_s == 50e9 and h100.gpus_per_node == 8
    assert "datasheet" in h100.source and "datasheet" in h200.source
    data = json.loads((load_cluster.__globals__["CLUSTERS_DIR"] / "h100.json").read_text())
    data["memory_bytes"] = 40e9
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    assert load_cluster(str(path)).memory_bytes == 40 * GB
    del data["inter_node"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing field 'inter_node'"):
        load_cluster(str(path))
    with pytest.raises(ValueError, match="unknown cluster 'a100'"):
        load_cluster("a100")


def test_plan_json_adds_predicted_figures_and_keeps_todays_fields(capsys):
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tokens_per_second", "mfu", "bubble_fraction", "candidates", "cluster"):
        assert key in plan
    for key in ("model", "num_parameters", "num_replicas", "settings", "bytes_per_parameter", "gpu_memory_bytes",
                "fits", "max_total_bytes", "stages", "suggestions", "balances"):
        assert key in plan
    assert plan["fits"] and 0 < plan["mfu"] < 0.6 and plan["max_total_bytes"] <= 80 * GB
    best = plan["candidates"][0]
    assert best["num_replicas"] * best["num_stages"] * best["tensor_parallel"] == 8
    assert f"--stages {best['num_stages']}" in best["job_command"]
    assert best["helm_values"]["training"]["stages"] == best["num_stages"]


def test_plan_says_plainly_when_nothing_fits(capsys):
    assert plan_main(["--cluster", "h100", "--model", "llama3-405b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "NOT POSSIBLE" in out and "tensor parallelism" in out


def test_plan_without_cluster_is_unchanged(capsys):
    assert plan_main(["--model", "tiny", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["precision"] == "fp32" and "step_time_s" not in plan
    assert plan_main(["--model", "tiny", "--gpus", "8"]) == 2
    assert "need --cluster" in capsys.readouterr().err


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_no_predicted_step_undercuts_the_searchs_optimistic_bound(schedule, t):
    # the search stops at the first bound that cannot beat its top: a bound above a step would lose the best
    config = LlamaConfig(vocab_size=4000, dim=256, n_layers=6, n_heads=8, n_kv_heads=2, ffn_dim=640, max_seq_len=512)
    cluster = unit_cluster(gpus_per_node=2, inter_node=Link(1e9, 1e-4), intra_node=Link(1e10, 1e-5))
    costs = llama_layer_costs(config, 512, "bf16")
    collectives = llama_layer_collectives(config, 512, "bf16") if t > 1 else None
    for shape in candidate_shapes(8, config.n_layers + 2, seq_len=512, schedules=(schedule,), tensor_parallels=(t,)):
        split = balance_by_time(costs, shape.num_stages, activation_checkpoint=shape.activation_checkpoint)
        bytes_of = LlamaStageBytes(config, shape)
        bounds = stage_bounds(split)
        parameters = [bytes_of.parameters(start, end) for start, end in bounds]
        memory = [bytes_of(stage, start, end) for stage, (start, end) in enumerate(bounds)]
        predicted = predict_split(costs, split, parameters, memory, None, shape, cluster,
                                  collectives=collectives).step_s
        assert optimistic_step_s(costs, split, parameters, shape, cluster, collectives) <= predicted * (1 + 1e-12), \
            shape
