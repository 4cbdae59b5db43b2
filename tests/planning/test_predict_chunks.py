"""The step-time predictor and the --cluster search on schedules of model chunks (interleaved_1f1b,
zbv): the prediction against the timed simulation run by hand, the bubbles theory gives, the
checks, the search's lower bound, memory and output. No Ray."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from raypipe.core.lowering import lower
from raypipe.core.ops import boundary_of, virtual_stage
from raypipe.core.partition import worker_chunks
from raypipe.core.schedule import PLACEMENT, make_schedule
from raypipe.core.timed_simulation import simulate_timed
from raypipe.models.layers import LayerCost
from raypipe.models.llama import LlamaConfig, get_config
from raypipe.models.llama_costs import llama_layer_costs
from raypipe.planning.balance import balance_by_time
from raypipe.planning.cluster_spec import Cluster, Link, load_cluster
from raypipe.planning.configuration_search import LlamaStageBytes, candidate_shapes, search_plans, worker_bytes
from raypipe.planning.memory import estimate_pipeline
from raypipe.planning.plan import main as plan_main
from raypipe.planning.plan import run_commands
from raypipe.planning.predict import (StepShape, optimistic_step_s, predict_split, predict_step, stage_bounds,
                                      worker_sums)

GB = 10**9
CHUNKED = ["interleaved_1f1b", "zbv"]


def unit_cluster(**changes) -> Cluster:
    """1 TFLOP/s reached in full, 8 GB/s links without latency, 60 GB/s memory, 8 GB/s host copies."""
    cluster = Cluster(name="unit", peak_flops={"bf16": 1e12, "fp32": 1e12}, memory_bytes=10**15,
                      memory_bandwidth_bytes_per_s=60e9, gpus_per_node=8, intra_node=Link(8e9, 0.0),
                      inter_node=Link(8e9, 0.0), host_copy_bytes_per_s=8e9, achievable_fraction=1.0)
    return replace(cluster, **changes)


def uneven_layers(count: int) -> list[LayerCost]:
    """Layers of different forward, backward halves and output sizes (so a mistaken virtual stage shows)."""
    return [LayerCost(fwd_flops=(1 + i % 3) * 1e11, bwd_input_flops=(2 + i % 2) * 1e11,
                      bwd_weight_flops=(1 + i % 4) * 1e11, saved_bytes=10**6, param_bytes=2 * 10**8,
                      output_bytes=(1 + i) * 10**8) for i in range(count)]


@pytest.mark.parametrize("schedule", CHUNKED)
def test_chunked_prediction_is_the_timed_simulation_by_hand(schedule):
    # p = 4 on nodes of 2 GPUs: the activations cross NVLink (fast) and the inter-node link (slow, with
    # latency), interleaving's wrap from worker 3 to worker 0 crosses nodes; recompute on all but the last
    p, m, v = 4, 8, 2
    costs = uneven_layers(12)
    cluster = unit_cluster(gpus_per_node=2, intra_node=Link(50e9, 1e-5), inter_node=Link(2e9, 3e-3))
    prediction = predict_step(costs, cluster, num_stages=p, num_micro_batches=m, schedule=schedule,
                              virtual_stages=v, activation_checkpoint="except_last", snapshot_every=0)
    split = list(prediction.balance)
    assert len(split) == p * v and sum(split) == len(costs)
    bounds = stage_bounds(split)
    placement = PLACEMENT[schedule]

    def piece_seconds(piece: int, field: str) -> float:
        start, end = bounds[piece]
        return sum(getattr(cost, field) for cost in costs[start:end]) / 1e12

    def op_seconds(worker: int, op) -> float:
        piece = virtual_stage(worker, op.chunk, p, placement)
        forward = piece_seconds(piece, "fwd_flops")
        recompute = forward if op.micro_batch is not None and op.micro_batch != m - 1 else 0.0
        return {"F": forward, "I": piece_seconds(piece, "bwd_input_flops") + recompute,
                "W": piece_seconds(piece, "bwd_weight_flops")}.get(op.kind, None) if op.kind != "B" else (
            piece_seconds(piece, "bwd_input_flops") + piece_seconds(piece, "bwd_weight_flops") + recompute)

    def collective_or_op(worker: int, op) -> float:
        seconds = op_seconds(worker, op)
        return 0.0 if seconds is None else seconds

    def message_seconds(sender: int, receiver: int, op) -> float:
        before = boundary_of(sender, op.chunk, op.kind, p, placement) - 1  # the virtual stage whose output it is
        link = cluster.intra_node if sender // 2 == receiver // 2 else cluster.inter_node
        return link.latency_s + costs[bounds[before][1] - 1].output_bytes / link.bandwidth_bytes_per_s

    lowered = lower(make_schedule(schedule, p, m, v), placement)
    run = simulate_timed(lowered, collective_or_op, message_seconds, buffered_sends=True, placement=placement)
    assert prediction.pipeline_s == pytest.approx(run.step_s, rel=1e-12)
    assert prediction.pipeline_bubble == pytest.approx(1 - sum(run.busy_s) / (p * run.step_s), rel=1e-12)
    # one replica: no reduction; the step is the pipeline and the slowest worker's optimizer step
    assert prediction.step_s == pytest.approx(run.step_s + prediction.optimizer_s, rel=1e-12)
    # each worker's compute: its two chunks' F and B of every micro-batch, and 7 recomputed forwards
    chunks = worker_chunks(split, p, placement)
    for worker, compute in enumerate(prediction.stage_compute_s):
        layers = [costs[i] for chunk in chunks[worker] for i in chunk]
        expected = sum(m * (c.fwd_flops + c.bwd_input_flops + c.bwd_weight_flops) + (m - 1) * c.fwd_flops
                       for c in layers) / 1e12
        assert compute == pytest.approx(expected, rel=1e-12)


def test_chunked_bubbles_are_below_1f1bs_as_theory_says():
    # p = 4, m = 8, 16 equal layers, messages free: 1F1B idles (p-1)/(m+p-1) = 3/11 of the pipeline,
    # interleaving at v = 2 (p-1)/(v m + p-1) = 3/19; zbv's V fills at m >= 2p - 1 (0.059, the schedule's docstring)
    layer = LayerCost(fwd_flops=1e12, bwd_input_flops=1e12, bwd_weight_flops=1e12, param_bytes=2 * GB)
    common = {"num_stages": 4, "num_micro_batches": 8, "snapshot_every": 0}
    one = predict_step([layer] * 16, unit_cluster(), schedule="1f1b", **common)
    interleaved = predict_step([layer] * 16, unit_cluster(), schedule="interleaved_1f1b", virtual_stages=2, **common)
    zbv = predict_step([layer] * 16, unit_cluster(), schedule="zbv", virtual_stages=2, **common)
    assert one.pipeline_bubble == pytest.approx(3 / 11)
    assert interleaved.pipeline_bubble == pytest.approx(3 / 19)
    assert zbv.pipeline_bubble == pytest.approx(1 / 17)
    assert zbv.step_s < interleaved.step_s < one.step_s
    assert interleaved.balance == zbv.balance == (2,) * 8


def test_interleaving_one_round_of_m_below_2p_is_predicted_as_its_timed_simulation():
    # p = 4, m = 6 (one round of 6, torch's flex order), 16 equal layers, messages free: the predictor's step is the
    # schedule's simulated step with buffered sends, as for every schedule: with F = 1 and B = 2 a chunk, 45 units
    # (22.5 in whole stages, against 1F1B's 27); under the rendezvous rule too (the wrap's receives posted when sent)
    layer = LayerCost(fwd_flops=1e12, bwd_input_flops=1e12, bwd_weight_flops=1e12, param_bytes=2 * GB)
    common = {"num_stages": 4, "num_micro_batches": 6, "snapshot_every": 0}
    one = predict_step([layer] * 16, unit_cluster(), schedule="1f1b", **common)
    interleaved = predict_step([layer] * 16, unit_cluster(), schedule="interleaved_1f1b", virtual_stages=2, **common)
    lowered = lower(make_schedule("interleaved_1f1b", 4, 6, 2), PLACEMENT["interleaved_1f1b"])
    units = [simulate_timed(lowered, {"F": 1.0, "B": 2.0}, buffered_sends=buffered).step_s
             for buffered in (True, False)]
    assert units == [45.0, 45.0]
    assert interleaved.pipeline_bubble == pytest.approx(1 - 6 * 2 * 3 / units[0]) == pytest.approx(0.2)
    assert one.pipeline_bubble == pytest.approx(3 / 9)


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": "interleaved_1f1b", "virtual_stages": 2, "num_micro_batches": 9},
     r"num_micro_batches=9: interleaved_1f1b needs m micro-batches that split into max\(1, m // p\) equal rounds"),
    ({"schedule": "interleaved_1f1b", "virtual_stages": 1}, "virtual_stages=1"),
    ({"schedule": "zbv", "virtual_stages": 3}, "virtual_stages=3"),
    ({"schedule": "zbv", "virtual_stages": 1}, "virtual_stages=1"),
    ({"schedule": "1f1b", "virtual_stages": 2}, "virtual_stages=2"),
    ({"schedule": "zbv", "virtual_stages": 2, "num_stages": 5}, "num_stages=5 x 2 chunks: only 8 layers"),
    ({"schedule": "zbv", "virtual_stages": 2, "balance": [2, 2, 2, 2]}, "needs 8 positive entries"),
])
def test_chunked_shapes_are_checked(kwargs, match):
    layer = LayerCost(fwd_flops=1e12, bwd_input_flops=1e12, bwd_weight_flops=1e12, param_bytes=2 * GB)
    arguments = {"num_stages": 4, "num_micro_batches": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        predict_step([layer] * 8, unit_cluster(), **arguments)


@pytest.mark.parametrize("schedule", CHUNKED)
def test_no_chunked_step_undercuts_the_searchs_optimistic_bound(schedule):
    config = LlamaConfig(vocab_size=4000, dim=256, n_layers=6, n_heads=8, n_kv_heads=2, ffn_dim=640, max_seq_len=512)
    cluster = unit_cluster(gpus_per_node=2, inter_node=Link(1e9, 1e-4), intra_node=Link(1e10, 1e-5))
    costs = llama_layer_costs(config, 512, "bf16")
    shapes = candidate_shapes(8, config.n_layers + 2, seq_len=512, schedules=(schedule,))
    assert shapes and all(shape.virtual_stages == 2 for shape in shapes)
    for shape in shapes:
        split = balance_by_time(costs, shape.num_virtual_stages, activation_checkpoint=shape.activation_checkpoint)
        bytes_of = LlamaStageBytes(config, shape)
        parameters = worker_sums([bytes_of.parameters(start, end) for start, end in stage_bounds(split)], shape)
        memory = worker_bytes(bytes_of, shape, split)
        predicted = predict_split(costs, split, parameters, memory, None, shape, cluster).step_s
        assert optimistic_step_s(costs, split, parameters, shape, cluster) <= predicted * (1 + 1e-12), shape


def test_chunked_candidates_need_an_m_interleaving_runs_and_enough_layers():
    # 16 GPUs, 10 layers, 48 sequences a step: p = 1, 2, 4 (p = 8 has 16 virtual stages for 10 layers), m =
    # 48 / (d b); interleaving where m splits into max(1, m // p) equal rounds (p = 2 at m = 3, p = 4 at m = 6: one
    # round of m)
    shapes = candidate_shapes(16, 10, seq_len=128, global_batch=48)
    assert {(s.schedule, s.num_stages, s.num_micro_batches) for s in shapes if s.virtual_stages > 1} == {
        ("interleaved_1f1b", 1, 3), ("zbv", 1, 3), ("interleaved_1f1b", 2, 6), ("zbv", 2, 6), ("zbv", 2, 3),
        ("interleaved_1f1b", 2, 3), ("interleaved_1f1b", 4, 12), ("zbv", 4, 12), ("zbv", 4, 6),
        ("interleaved_1f1b", 4, 6)}
    assert all(s.virtual_stages == (2 if s.schedule in CHUNKED else 1) for s in shapes)
    # 40 sequences on 8 GPUs at p = 4 (two replicas): m = 20 or 10 a replica (micro-batch sizes 1, 2), 10 in two
    # rounds of 5 > p; 36 sequences: m = 18 or 9, neither splitting into m // p equal rounds, refused
    assert {s.num_micro_batches for s in candidate_shapes(8, 10, seq_len=128, global_batch=40,
                                                          schedules=("interleaved_1f1b",)) if s.num_stages == 4} == {
        20, 10}
    assert not [s for s in candidate_shapes(8, 10, seq_len=128, global_batch=36, schedules=("interleaved_1f1b",))
                if s.num_stages == 4]


@pytest.mark.parametrize("schedule", CHUNKED)
def test_fast_worker_bytes_are_the_memory_model(schedule):
    config = LlamaConfig(vocab_size=1000, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=128)
    split = [1, 1, 1, 1, 2, 2]
    for recompute in ("never", "always", "except_last"):
        for sharded in (False, True):
            shape = StepShape(num_replicas=4, num_stages=3, num_micro_batches=6, schedule=schedule,
                              activation_checkpoint=recompute, precision="bf16", shard_optimizer=sharded,
                              micro_batch_size=2, seq_len=128, virtual_stages=2)
            expected = [stage.total_bytes for stage in estimate_pipeline(
                config, 3, 6, 2, 128, "bf16", recompute, balance=split, schedule=schedule,
                optimizer_shards=4 if sharded else 1, virtual_stages=2)]
            assert worker_bytes(LlamaStageBytes(config, shape), shape, split) == expected, (recompute, sharded)


def test_the_search_picks_a_chunked_schedule_and_prints_how_to_run_it(capsys):
    # llama3-8b on 64 H100 without tensor parallelism: zbv's V (nearly no bubble) on 4 stages beats zb_h1 and 1F1B
    result = search_plans(get_config("llama3-8b"), load_cluster("h100"), 64, top=2, tensor_parallel=1)
    best = result.best[0]
    assert (best.shape.schedule, best.shape.virtual_stages) == ("zbv", 2)
    assert len(best.prediction.balance) == 2 * best.shape.num_stages
    commands = run_commands("llama3-8b", best)
    assert "--schedule zbv --virtual-stages 2" in commands["job_command"]
    assert commands["helm_values"]["training"]["virtualStages"] == 2
    assert commands["helm_values"]["training"]["schedule"] == "zbv"
    one_chunk = next(c for c in result.best if c.shape.virtual_stages == 1)
    assert "--virtual-stages" not in run_commands("llama3-8b", one_chunk)["job_command"]
    assert "virtualStages" not in run_commands("llama3-8b", one_chunk)["helm_values"]["training"]

    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--top", "2", "--json",
                      "--tensor-parallel", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [item["virtual_stages"] for item in plan["candidates"]] == [2, 1]
    assert plan["candidates"][0]["schedule"] == "zbv" and len(plan["candidates"][0]["balance"]) == 8
    assert plan["settings"]["virtual_stages"] == 2 and len(plan["stages"]) == 4
    assert len(plan["balances"]["time"]["stage_total_bytes"]) == 4
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "64", "--top", "2",
                      "--tensor-parallel", "1"]) == 0
    text = capsys.readouterr().out
    assert "zbv v=2" in text and "--schedule zbv --virtual-stages 2" in text and '"virtualStages": 2' in text


def test_goodput_counts_a_chunked_workers_state_over_its_chunks():
    from raypipe.planning.plan import run_shape

    config = get_config("llama3-8b")
    best = search_plans(config, load_cluster("h100"), 64, top=1, tensor_parallel=1).best[0]
    assert best.shape.virtual_stages == 2
    shape = run_shape(config, best, load_cluster("h100"))
    one_chunk = replace(best.shape, schedule="1f1b", virtual_stages=1)
    halves = replace(best, shape=one_chunk)  # the same balance read as 8 one-chunk stages: smaller workers
    assert shape.largest_worker_state_bytes > run_shape(config, halves, load_cluster("h100")).largest_worker_state_bytes
    assert shape.model_state_bytes == run_shape(config, halves, load_cluster("h100")).model_state_bytes
