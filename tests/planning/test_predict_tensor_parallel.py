"""The planner with tensor parallelism (no Ray): one rank's memory rows against the memory model,
the step time at t by hand (compute / t plus the collectives), the search choosing t for a 70B
on 512 H100s, the CLI's flags and its errors."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from raypipe.errors import ConfigError
from raypipe.models.layers import LayerCost
from raypipe.models.llama import LlamaConfig, get_config
from raypipe.planning.cluster_spec import Cluster, Link, load_cluster
from raypipe.planning.configuration_search import LlamaStageBytes, search_plans
from raypipe.planning.memory import estimate_pipeline, estimate_stage
from raypipe.planning.plan import main as plan_main
from raypipe.planning.predict import StepShape, predict_step
from raypipe.planning.tensor_parallel_collectives import collective_seconds, llama_layer_collectives

GB = 10**9
NO_MEMORY = lambda *_: 0  # noqa: E731 (the hand-computed steps need no memory model)


def unit_cluster(**changes) -> Cluster:
    """1 TFLOP/s reached in full, 8 GB/s links without latency, 2 GPUs a node."""
    cluster = Cluster(name="unit", peak_flops={"bf16": 1e12}, memory_bytes=10**15, memory_bandwidth_bytes_per_s=60e9,
                      gpus_per_node=2, intra_node=Link(8e9, 0.0), inter_node=Link(8e9, 0.0),
                      host_copy_bytes_per_s=8e9, achievable_fraction=1.0)
    return replace(cluster, **changes)


# 1 s forward and 2 s backward per sequence on one GPU, an 8 GB output, no parameters
LAYER = LayerCost(fwd_flops=1e12, bwd_input_flops=1e12, bwd_weight_flops=1e12, output_bytes=8 * GB)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_fast_stage_bytes_at_t2_are_the_memory_models(sequence_parallel):
    config = LlamaConfig(vocab_size=1001, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=128)
    for schedule, recompute, sharded in [("gpipe", "never", False), ("1f1b", "always", True),
                                         ("zb_h1", "except_last", False)]:
        shape = StepShape(num_replicas=4, num_stages=3, num_micro_batches=5, schedule=schedule,
                          activation_checkpoint=recompute, precision="bf16", shard_optimizer=sharded,
                          micro_batch_size=2, seq_len=128, tensor_parallel=2, sequence_parallel=sequence_parallel)
        fast = LlamaStageBytes(config, shape)
        for stage, (start, end) in enumerate([(0, 2), (2, 5), (5, 8)]):
            expected = estimate_stage(config, range(start, end), num_micro_batches=5, micro_batch_size=2,
                                      seq_len=128, precision="bf16", activation_checkpoint=recompute,
                                      schedule=schedule, stage_index=stage, num_stages=3,
                                      optimizer_shards=4 if sharded else 1, tensor_parallel=2,
                                      sequence_parallel=sequence_parallel)
            assert fast(stage, start, end) == expected.total_bytes, (schedule, recompute, stage)
            assert fast.parameters(start, end) == expected.num_parameters


def test_step_time_at_t_by_hand():
    # one stage of 4 layers, one micro-batch, gpipe: at t = 1, F = 4 s and B = 8 s
    one = predict_step([LAYER] * 4, unit_cluster(), schedule="gpipe", snapshot_every=0)
    assert one.step_s == pytest.approx(12.0)
    # at t = 2 each layer's compute halves (F 0.5 s, B 1 s), and each layer all-reduces its 8 GB output twice in
    # forward and twice in backward: a ring all-reduce moves 2 (t-1)/t x 8 GB = 8 GB through each GPU's 8 GB/s
    # link, 1 s each: F = 4 x (0.5 + 2) = 10 s, B = 4 x (1 + 2) = 12 s
    two = predict_step([LAYER] * 4, unit_cluster(), schedule="gpipe", snapshot_every=0, tensor_parallel=2, seq_len=2,
                       stage_bytes=NO_MEMORY)
    assert two.step_s == pytest.approx(22.0)
    assert two.step_s - one.step_s / 2 == pytest.approx(16.0)  # the compute halves; the collectives add 16 s
    assert two.mfu == pytest.approx(4 * 3e12 / (22.0 * 2 * 1e12))  # 2 GPUs
    # a latency of 0.1 s: a ring all-reduce over 2 ranks takes 2 (t-1) = 2 steps, +0.2 s each of the 16
    slow = predict_step([LAYER] * 4, unit_cluster(intra_node=Link(8e9, 0.1)), schedule="gpipe", snapshot_every=0,
                        seq_len=2,
                        tensor_parallel=2, stage_bytes=NO_MEMORY)
    assert slow.step_s == pytest.approx(22.0 + 16 * 0.2)
    # two stages of 2 layers on two nodes (one 2-GPU slot a node): F = 5, B = 6 s per stage, and the 8 GB
    # activation and its gradient cross the 8 GB/s inter-node link, each rank sending 1/t of it (its 4 GB shard with
    # sequence parallelism, its slice of the whole without): 0.5 s. Without sequence parallelism stage 1's forward
    # all-gathers the slices over its node (one ring pass of (t-1)/t x 8 GB: 0.5 s), and stage 0's backward the
    # gradient's: F0 + message + F1 (+ gather) + B1 + message + B0 (+ gather)
    for sequence_parallel, gather in [(True, 0.0), (False, 0.5)]:
        split = predict_step([LAYER] * 4, unit_cluster(), num_stages=2, schedule="gpipe", snapshot_every=0, seq_len=2,
                             tensor_parallel=2, sequence_parallel=sequence_parallel, stage_bytes=NO_MEMORY)
        assert split.step_s == pytest.approx(5 + 0.5 + 5 + gather + 6 + 0.5 + 6 + gather)
    # a node link 4x faster (32 GB/s): each all-reduce and gather takes a quarter (F = 2 x (0.5 + 0.5) = 2 s,
    # B = 2 x (1 + 0.5) = 3 s, a gather 0.125 s), the messages stay on the 8 GB/s inter-node link
    fast_node = predict_step([LAYER] * 4, unit_cluster(intra_node=Link(32e9, 0.0)), num_stages=2, schedule="gpipe",
                             snapshot_every=0, seq_len=2, tensor_parallel=2, sequence_parallel=False,
                             stage_bytes=NO_MEMORY)
    assert fast_node.step_s == pytest.approx(2 + 0.5 + 2 + 0.125 + 3 + 0.5 + 3 + 0.125)


def test_the_llamas_collectives_by_hand():
    config = get_config("llama3-70b")
    hidden = 2 * 8192 * config.dim  # one sequence's bf16 hidden state
    link = load_cluster("h100").intra_node
    for sequence_parallel in (True, False):
        embedding, *blocks, head = llama_layer_collectives(config, 8192, "bf16", sequence_parallel=sequence_parallel)
        assert len(blocks) == config.n_layers
        # a block moves the same bytes either way: 2 all-reduces (2 passes each), or 2 x (all-gather + reduce-scatter)
        assert sum(p * size for p, size in blocks[0].forward) == sum(p * size for p, size in blocks[0].backward) \
            == 4 * hidden
        # the embedding: an all-reduce of its output, or a reduce-scatter and (backward) an all-gather
        assert [p for p, _ in embedding.forward + embedding.backward] == ([1, 1] if sequence_parallel else [2])
    # at t = 8 on NVLink 4 (450 GB/s a direction, 5 us): an all-reduce of a 70B's 256 MiB hidden state
    seconds = collective_seconds([(2, hidden)], 8, link, 1)
    assert seconds == pytest.approx(2 * 7 / 8 * hidden / 450e9 + 2 * 7 * 5e-6)
    assert collective_seconds([(2, hidden)], 1, link, 1) == 0.0


def test_search_picks_tensor_parallelism_for_a_70b():
    """On 64 H100s with a global batch of 64 sequences (a search of seconds; the 512-GPU search with
    every batch, which picks t = 8 as well, is in benchmarks/RESULTS.md's planner section)."""
    config, cluster = get_config("llama3-70b"), load_cluster("h100")
    searched = search_plans(config, cluster, 64, global_batch=64, top=1)  # the best alone: fewer simulated
    alone = search_plans(config, cluster, 64, global_batch=64, tensor_parallel=1, top=1)
    best, flat = searched.best[0], alone.best[0]
    print(f"llama3-70b on 64 h100: t={best.shape.tensor_parallel} p={best.shape.num_stages} "
          f"d={best.shape.num_replicas} {best.shape.schedule} recompute={best.shape.activation_checkpoint}: "
          f"MFU {best.prediction.mfu:.1%}; t=1: p={flat.shape.num_stages} {flat.shape.schedule} "
          f"recompute={flat.shape.activation_checkpoint}: MFU {flat.prediction.mfu:.1%}")
    assert best.shape.tensor_parallel > 1 and best.prediction.fits
    assert best.shape.num_gpus == 64 and best.shape.snapshot_every >= 1  # snapshots (of local shards) as at t = 1
    assert best.prediction.tokens_per_s > flat.prediction.tokens_per_s
    assert best.to_dict()["tensor_parallel"] == best.shape.tensor_parallel


def test_plan_tensor_parallel_flag_gives_one_ranks_rows(capsys):
    assert plan_main(["--model", "tiny", "--stages", "2", "--micro-batches", "4", "--tensor-parallel", "2",
                      "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["tensor_parallel"] == 2 and plan["settings"]["sequence_parallel"] is None
    expected = estimate_pipeline(get_config("tiny"), 2, 4, 1, 256, tensor_parallel=2)
    assert [row["total_bytes"] for row in plan["stages"]] == [stage.total_bytes for stage in expected]
    assert plan["stages"][0]["num_parameters"] < plan["num_parameters"] / 2  # a rank's half of a stage's
    # without the flag (or at t = 1) the plan reads as before: no tensor-parallel settings
    assert plan_main(["--model", "tiny", "--json"]) == 0
    default = capsys.readouterr().out
    assert plan_main(["--model", "tiny", "--json", "--tensor-parallel", "1"]) == 0
    assert capsys.readouterr().out == default and "tensor_parallel" not in json.loads(default)["settings"]
    assert plan_main(["--model", "tiny"]) == 0
    assert "tensor parallel" not in capsys.readouterr().out
    # --cluster: t fixed, the commands that run it
    assert plan_main(["--cluster", "h100", "--model", "llama3-8b", "--gpus", "8", "--tensor-parallel", "2",
                      "--no-sequence-parallel", "--json", "--top", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for item in plan["candidates"]:
        assert item["tensor_parallel"] == 2 and item["sequence_parallel"] is False
        assert item["num_replicas"] * item["num_stages"] * 2 == 8
        assert "--tensor-parallel 2 --no-sequence-parallel" in item["job_command"]
        assert item["helm_values"]["training"]["tensorParallel"] == 2
        assert item["helm_values"]["training"]["sequenceParallel"] is False
        assert item["helm_values"]["training"]["snapshotEvery"] == item["snapshot_every"] >= 1
    assert plan["settings"]["tensor_parallel"] == 2


@pytest.mark.parametrize("argv, first_line", [
    (["--model", "tiny", "--tensor-parallel", "3"],
     "raypipe plan: error: invalid tensor_parallel=3: must divide the model's n_heads=4"),
    (["--cluster", "h100", "--model", "llama3-70b", "--gpus", "512", "--tensor-parallel", "16"],
     "raypipe plan: error: tensor_parallel=16 exceeds the 8 GPUs per node of cluster 'h100'"),
    (["--cluster", "h100", "--model", "llama3-70b", "--gpus", "512", "--tensor-parallel", "3"],
     "raypipe plan: error: invalid tensor_parallel=3: must divide the model's n_heads=64"),
])
def test_plan_refuses_a_tensor_parallel_degree_that_cannot_run(capsys, argv, first_line):
    assert plan_main(argv) == 2
    assert capsys.readouterr().err.splitlines()[0].startswith(first_line)


def test_search_refuses_what_cannot_run():
    with pytest.raises(ConfigError, match="must divide the model's n_heads=64"):
        search_plans(get_config("llama3-70b"), load_cluster("h100"), 48, tensor_parallel=3)
    with pytest.raises(ValueError, match="exceeds the 8 GPUs per node"):
        search_plans(get_config("llama3-70b"), load_cluster("h100"), 512, tensor_parallel=16)
    with pytest.raises(ValueError, match="does not divide --gpus 12"):
        search_plans(get_config("llama3-70b"), load_cluster("h100"), 12, tensor_parallel=8)
