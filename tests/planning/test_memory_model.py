"""The memory model against measurements (saved-tensor hooks on CPU) and the standard figures."""
from __future__ import annotations

import argparse
import contextlib
import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from raypipe.planning.memory import (
    StageMemory,
    StaticBytes,
    activation_breakdown,
    estimate_layer_activation_bytes,
    estimate_pipeline,
    estimate_stage,
    spec_parameter_count,
    stage_input_bytes,
    static_bytes_per_parameter,
)
from raypipe.models.llama import get_config, llama_layers, llama_loss, num_parameters
from raypipe.planning.plan import add_plan_arguments, run_plan
from raypipe.stage.precision import Bf16ComputeWeights, ModuleWeights
from raypipe.units import format_bytes, parse_bytes

TINY = get_config("tiny")


class SavedBytes:
    """Bytes of the distinct storages autograd saves inside the context (parameters, and
    the storages in ``skip``, excluded)."""

    def __init__(self, modules, skip=frozenset()) -> None:
        self.skip = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()} | skip
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen and storage.data_ptr() not in self.skip:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def build_layers(config, seed=0):
    torch.manual_seed(seed)
    return [spec.build() for spec in llama_layers(config)]


def measure_layer(config, kind, batch, seq_len, contexts=(), bf16_weights=False):
    """Forward one layer of ``kind`` on a fresh input; return the saved bytes.

    ``bf16_weights``: as a bf16 stage runs it, with bf16 compute weights (not
    counted, like parameters) on a bf16 input, under autocast.
    """
    layers = build_layers(config)
    layer = {"embedding": layers[0], "block": layers[1], "head": layers[-1]}[kind]
    weights, skip, dtype = ModuleWeights(), frozenset(), torch.float32
    if bf16_weights:
        weights = Bf16ComputeWeights(torch.nn.ModuleList([layer]), torch.device("cpu"))
        skip, dtype = weights.storages(), torch.bfloat16
        contexts = [*contexts, torch.autocast("cpu", dtype=torch.bfloat16)]
    if kind == "embedding":
        inputs = torch.randint(0, config.vocab_size, (batch, seq_len))
    else:
        inputs = torch.randn(batch, seq_len, config.dim, dtype=dtype, requires_grad=True)
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        with SavedBytes([layer], skip) as meter:
            weights.run(0, layer, inputs)
    return meter.bytes


def assert_close(predicted: int, measured: int, tolerance: float = 0.01) -> None:
    assert measured > 0
    assert abs(predicted - measured) / measured <= tolerance, (predicted, measured)


# -- one layer, one micro-batch, "never" ----------------------------------------------------

@pytest.mark.parametrize("kind", ["embedding", "block", "head"])
@pytest.mark.parametrize("batch, seq_len", [(1, 8), (2, 32), (3, 100)])
def test_layer_prediction_matches_saved_tensors_fp32(kind, batch, seq_len):
    predicted = estimate_layer_activation_bytes(TINY, kind, batch, seq_len, "fp32", fused_attention=True)
    assert_close(predicted, measure_layer(TINY, kind, batch, seq_len))


@pytest.mark.parametrize("batch, seq_len", [(2, 16), (1, 64)])
def test_loss_prediction_matches_saved_tensors(batch, seq_len):
    logits = torch.randn(batch, seq_len, TINY.vocab_size, requires_grad=True)
    targets = torch.randint(0, TINY.vocab_size, (batch, seq_len))
    with SavedBytes([]) as meter:
        llama_loss(logits, targets) * 0.5
    assert_close(estimate_layer_activation_bytes(TINY, "loss", batch, seq_len), meter.bytes)


def test_unfused_attention_prediction_matches_the_math_kernel():
    measured = measure_layer(TINY, "block", 2, 48, [sdpa_kernel(SDPBackend.MATH)])
    predicted = estimate_layer_activation_bytes(TINY, "block", 2, 48, "fp32", fused_attention=False)
    assert_close(predicted, measured)
    fused = estimate_layer_activation_bytes(TINY, "block", 2, 48, "fp32", fused_attention=True)
    probabilities = 2 * TINY.n_heads * 48 * 48 * 4
    assert predicted - fused >= probabilities - 2 * 48 * TINY.dim * 4  # the (s x s) matrix is the difference


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_query_attention_prediction(fused):
    config = TINY.replace(n_kv_heads=2)
    contexts = [] if fused else [sdpa_kernel(SDPBackend.MATH)]
    assert_close(estimate_layer_activation_bytes(config, "block", 2, 24, "fp32", fused),
                 measure_layer(config, "block", 2, 24, contexts))


@pytest.mark.parametrize("kind", ["block", "head"])
def test_autocast_bf16_prediction_matches_saved_tensors(kind):
    measured = measure_layer(TINY, kind, 2, 40, [torch.autocast("cpu", dtype=torch.bfloat16)])
    predicted = estimate_layer_activation_bytes(TINY, kind, 2, 40, "bf16", amp="autocast")
    assert_close(predicted, measured)
    # autocast saves a 2-byte copy of every weight of the layer, per forward
    breakdown = activation_breakdown(TINY, kind, 2, 40, "bf16", amp="autocast")
    copies = sum(v for k, v in breakdown.items() if "weight_copy" in k)
    layer = build_layers(TINY)[1 if kind == "block" else -1]
    norms = sum(p.numel() for name, p in layer.named_parameters() if "norm" in name)
    assert copies == 2 * (sum(p.numel() for p in layer.parameters()) - norms)


@pytest.mark.parametrize("kind", ["embedding", "block", "head"])
@pytest.mark.parametrize("fused", [True, False])
def test_bf16_main_weights_prediction_matches_saved_tensors(kind, fused):
    """raypipe's bf16 (the default style): shared bf16 compute weights under autocast."""
    contexts = [] if fused else [sdpa_kernel(SDPBackend.MATH)]
    measured = measure_layer(TINY, kind, 2, 40, contexts, bf16_weights=True)
    assert_close(estimate_layer_activation_bytes(TINY, kind, 2, 40, "bf16", fused), measured)
    breakdown = activation_breakdown(TINY, kind, 2, 40, "bf16", fused)
    assert breakdown == activation_breakdown(TINY, kind, 2, 40, "bf16", fused, amp="main_weights")
    assert not any("weight_copy" in name for name in breakdown)  # no weight saved per forward
    if kind != "embedding":  # far less than autocast on fp32 weights, which saves their copies
        assert measured < 0.7 * estimate_layer_activation_bytes(TINY, kind, 2, 40, "bf16", fused, amp="autocast")


def test_bf16_main_weights_dropout_masks_on_cpu():
    config = TINY.replace(dropout=0.1)
    measured = measure_layer(config, "block", 2, 16, bf16_weights=True)
    assert_close(estimate_layer_activation_bytes(config, "block", 2, 16, "bf16", device="cpu"), measured)


def test_dropout_masks_on_cpu():
    config = TINY.replace(dropout=0.1)
    predicted = estimate_layer_activation_bytes(config, "block", 2, 16, device="cpu")
    assert_close(predicted, measure_layer(config, "block", 2, 16))
    # CUDA keeps 1-byte masks
    cuda = estimate_layer_activation_bytes(config, "block", 2, 16, device="cuda")
    assert predicted - cuda == 2 * (4 - 1) * 2 * 16 * config.dim


# -- a whole stage, single process ----------------------------------------------------------

def run_stage_forward(layers, inputs, with_loss, segments=None):
    """The stage's forward as a stage runs it (optionally checkpointed in segments), metered."""
    from torch.utils.checkpoint import checkpoint

    def segment(chunk, hidden):
        for layer in chunk:
            hidden = layer(hidden)
        return hidden

    with SavedBytes(layers) as meter:
        hidden = inputs
        size = segments or len(layers)
        for start in range(0, len(layers), size):
            chunk = layers[start:start + size]
            hidden = checkpoint(segment, chunk, hidden, use_reentrant=False) if segments else segment(chunk, hidden)
        if with_loss:
            llama_loss(hidden.float(), torch.randint(0, TINY.vocab_size, hidden.shape[:2]))
        else:
            meter.pack(hidden)  # a non-last stage keeps its output alive as the graph's root
    return meter.bytes


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("segments", [None, 1, 2])
def test_stage_graph_prediction_matches_measurement(first, segments):
    layers = build_layers(TINY)
    indices = range(3) if first else range(3, 6)
    batch, seq_len = 2, 32
    inputs = (torch.randint(0, 259, (batch, seq_len)) if first
              else torch.randn(batch, seq_len, TINY.dim, requires_grad=True))
    measured = run_stage_forward([layers[i] for i in indices], inputs, with_loss=not first, segments=segments)
    stage = estimate_stage(TINY, indices, num_micro_batches=1, micro_batch_size=batch, seq_len=seq_len,
                           activation_checkpoint_segments=segments, device="cpu")
    assert_close(stage.graph_bytes, measured)


# -- schedules and checkpoint modes -------------------------------------------------------------

def stage_memory(**overrides) -> StageMemory:
    settings = {"num_micro_batches": 8, "micro_batch_size": 2, "seq_len": 64, "stage_index": 1, "num_stages": 3}
    settings.update(overrides)
    return estimate_stage(TINY, range(2, 4), **settings)


def test_checkpoint_modes_hold_what_gpipe_keeps():
    never = stage_memory(activation_checkpoint="never")
    graph, kept = never.graph_bytes, never.input_bytes
    assert kept == 2 * 64 * TINY.dim * 4
    assert never.activation_bytes == 8 * graph
    # the micro-batch being rebuilt: its kept input is not counted twice
    assert stage_memory(activation_checkpoint="always").activation_bytes == 8 * kept + graph - kept
    assert stage_memory(activation_checkpoint="except_last").activation_bytes == 7 * kept + graph
    offloaded = stage_memory(activation_checkpoint="always", offload_activations=True)
    assert (offloaded.activation_bytes, offloaded.offloaded_bytes) == (graph, 8 * kept)  # about one micro-batch
    offloaded = stage_memory(activation_checkpoint="except_last", offload_activations=True)
    assert (offloaded.activation_bytes, offloaded.offloaded_bytes) == (graph, 7 * kept)


def test_one_f_one_b_holds_at_most_stages_minus_index_micro_batches():
    for index, in_flight in [(0, 3), (1, 2), (2, 1)]:
        memory = stage_memory(activation_checkpoint="never", schedule="1f1b", stage_index=index)
        assert memory.micro_batches_in_flight == in_flight
        assert memory.activation_bytes == in_flight * memory.graph_bytes


def test_zb_h1_holds_each_graph_from_its_forward_to_its_weight_gradient():
    """ZB-H1 defers W ops into the bubble, and the graph stays retained from I until W: every stage
    then holds p micro-batches, 1F1B's first-stage peak (the schedule's memory claim), where 1F1B's
    later stages hold fewer; a recomputed graph, rebuilt at I, stays whole until W."""
    for index in range(3):
        memory = stage_memory(activation_checkpoint="never", schedule="zb_h1", stage_index=index)
        assert memory.micro_batches_in_flight == 3
        assert memory.activation_bytes == 3 * memory.graph_bytes
    # the last stage runs F0 I0 F1 I1 F2 I2 W0 ...: three rebuilt graphs are held at once, where
    # an unsplit backward rebuilds one at a time
    last = stage_memory(activation_checkpoint="always", schedule="zb_h1", stage_index=2)
    rebuilt = last.graph_bytes - last.input_bytes
    assert last.activation_bytes == 3 * last.input_bytes + 3 * rebuilt
    assert stage_memory(activation_checkpoint="always", schedule="1f1b", stage_index=2).activation_bytes == (
        last.input_bytes + rebuilt)


def test_segments_keep_segment_inputs_and_recompute_one_segment():
    four_blocks = range(1, 5)
    full = estimate_stage(TINY, four_blocks, num_micro_batches=4, micro_batch_size=2, seq_len=64)
    for size, segments in [(1, 4), (2, 2)]:
        memory = estimate_stage(TINY, four_blocks, num_micro_batches=4, micro_batch_size=2, seq_len=64,
                                activation_checkpoint_segments=size)
        # every segment's input, plus the stage output (the graph's root)
        assert memory.graph_bytes == (segments + 1) * full.input_bytes
        block = estimate_layer_activation_bytes(TINY, "block", 2, 64)
        assert memory.held_for_backward_bytes == 4 * memory.graph_bytes  # what a stage's meter sees
        assert memory.activation_bytes == 4 * memory.graph_bytes + size * block - full.input_bytes


def test_bad_stage_arguments_are_clear():
    with pytest.raises(ValueError, match="offload"):
        stage_memory(activation_checkpoint="never", offload_activations=True)
    with pytest.raises(ValueError, match="activation_checkpoint='sometimes'"):
        stage_memory(activation_checkpoint="sometimes")
    with pytest.raises(ValueError, match="seq_len=300"):
        stage_memory(seq_len=300)
    with pytest.raises(ValueError, match="layer_indices"):
        estimate_stage(TINY, [1, 3], num_micro_batches=1, micro_batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="only 6 layers"):
        estimate_pipeline(TINY, 7, 1, 1, 8)


def test_pipeline_partition_covers_every_layer_once():
    stages = estimate_pipeline(TINY, 2, 4, 2, 32)
    assert [s.layers for s in stages] == [[0, 1, 2], [3, 4, 5]]
    assert sum(s.num_parameters for s in stages) == num_parameters(TINY)
    assert stages[0].input_bytes == 2 * 32 * 8  # token ids
    assert stage_input_bytes(TINY, 3, 2, 32) == 2 * 32 * TINY.dim * 4


# -- the standard figures ------------------------------------------------------------------------

def test_bf16_with_adam_plans_18_bytes_per_parameter():
    # raypipe's bf16: bf16 compute weights + fp32 main weights + fp32 main gradients + Adam m, v
    assert static_bytes_per_parameter("bf16") == StaticBytes(weights=2, gradients=4, master=4, optimizer=8)
    assert static_bytes_per_parameter("bf16").total == 18
    # fp32: weights + gradients + Adam m, v
    assert static_bytes_per_parameter("fp32") == StaticBytes(weights=4, gradients=4, master=0, optimizer=8)
    assert static_bytes_per_parameter("fp32").total == 16
    # fp16 runs autocast on fp32 weights
    assert static_bytes_per_parameter("fp16") == static_bytes_per_parameter("bf16", amp="autocast")
    assert static_bytes_per_parameter("fp16").total == 16
    for precision, per_parameter in [("bf16", 18), ("fp32", 16)]:
        stage = estimate_stage(TINY, range(2, 4), num_micro_batches=2, micro_batch_size=1, seq_len=8,
                               precision=precision)
        assert stage.static_bytes == per_parameter * stage.num_parameters
        assert (stage.parameters_bytes, stage.master_bytes, stage.gradients_bytes) == tuple(
            count * stage.num_parameters for count in ((2, 4, 4) if precision == "bf16" else (4, 0, 4)))


def test_7b_standard_mixed_precision_adam_is_16_bytes_per_parameter():
    """The common table (2-byte gradients): 16 B/param, a 7B model ~112 GB; raypipe's bf16 adds
    2 B/param of fp32 main gradients."""
    config = get_config("llama-7b")
    assert static_bytes_per_parameter("bf16", amp="standard") == StaticBytes(2, 2, 4, 8)
    standard = estimate_pipeline(config, 8, 32, 1, 4096, "bf16", "always", amp="standard")
    static = sum(s.static_bytes for s in standard)
    assert static == 16 * num_parameters(config)
    assert abs(static - 112e9) / 112e9 < 0.05
    assert sum(s.master_bytes for s in standard) == 4 * num_parameters(config)
    raypipe = estimate_pipeline(config, 8, 32, 1, 4096, "bf16", "always")
    assert sum(s.static_bytes for s in raypipe) == static + 2 * num_parameters(config)


def test_unfused_attention_scores_are_4_3_gb_per_layer():
    config = get_config("llama-7b").replace(max_seq_len=8192)
    probabilities = activation_breakdown(config, "block", 1, 8192, "bf16", fused_attention=False,
                                         amp="standard")["attention_probs"]
    assert probabilities == 1 * 32 * 8192 * 8192 * 2
    assert abs(probabilities - 4.3e9) / 4.3e9 < 0.01
    assert "attention_probs" not in activation_breakdown(config, "block", 1, 8192, "bf16", fused_attention=True)
    # under autocast torch's math attention upcasts bf16 inputs: fp32 probabilities
    upcast = activation_breakdown(config, "block", 1, 8192, "bf16", fused_attention=False)["attention_probs"]
    assert upcast == 2 * probabilities


def test_llama_7b_parameter_count_from_analytic_and_meta_build():
    config = get_config("llama-7b")
    assert num_parameters(config) == spec_parameter_count(config)
    assert abs(num_parameters(config) - 6.74e9) / 6.74e9 < 0.001


# -- raypipe plan ------------------------------------------------------------------------------

def plan(*argv: str, capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    status = run_plan(parser.parse_args(list(argv)))
    captured = capsys.readouterr()
    return status, captured.out + captured.err


SEVEN_B = ["--model", "llama-7b", "--stages", "8", "--micro-batches", "32", "--micro-batch-size", "1",
           "--seq-len", "4096", "--precision", "bf16", "--activation-checkpoint", "always", "--gpu-memory", "80GB"]


def test_plan_table_for_7b_on_8_stages(capsys):
    status, out = plan(*SEVEN_B, capsys=capsys)
    assert status == 0
    assert "embedding + blocks 0-3" in out and "blocks 28-31 + head" in out
    assert "fits in 80.00 GB" in out and "NO" not in out
    assert "bf16 (main_weights)" in out
    assert ("per parameter: 2 B bf16 compute weights + 4 B fp32 main weights + 4 B fp32 main gradients "
            "+ 8 B Adam moments = 18 B") in out
    assert "16 B/param" in out and "2 + 4 + 2 + 8" in out  # how it relates to the common table
    # snapshots: the fp32 main weights and Adam moments (12 B/param) of the largest stage
    largest = max(row["snapshot_bytes"] for row in json.loads(plan(*SEVEN_B, "--json", capsys=capsys)[1])["stages"])
    assert f"host memory up to 2 x {format_bytes(largest)} per worker" in out
    # a background checkpoint save in flight: one more copy of the same state
    assert f"background checkpoint saves (fit): one more host copy of up to {format_bytes(largest)} per worker" in out


def test_plan_with_a_sharded_optimizer_divides_the_optimizer_state_and_main_weights(capsys):
    whole = json.loads(plan(*SEVEN_B, "--json", capsys=capsys)[1])
    sharded = json.loads(plan(*SEVEN_B, "--replicas", "4", "--shard-optimizer", "--json", capsys=capsys)[1])
    assert sharded["settings"]["optimizer_shards"] == 4
    for one, quarter in zip(whole["stages"], sharded["stages"]):
        # bf16: each replica keeps the fp32 main weights and Adam moments of the parameters it owns
        for kind in ("optimizer_bytes", "master_bytes"):
            assert quarter[kind] == -(-one[kind] // 4)
        # and the bf16 compute weights and fp32 main gradients of all of them
        for kind in ("parameters_bytes", "gradients_bytes", "activation_bytes"):
            assert quarter[kind] == one[kind]
        # a snapshot: its own fp32 main weights and Adam moments, the other 3/4's bf16 compute weights
        assert quarter["snapshot_bytes"] == pytest.approx(
            (one["master_bytes"] + one["optimizer_bytes"]) / 4 + 0.75 * one["parameters_bytes"], rel=1e-6)
        assert one["snapshot_bytes"] == one["master_bytes"] + one["optimizer_bytes"]
    replicated = json.loads(plan(*SEVEN_B, "--replicas", "4", "--json", capsys=capsys)[1])
    assert replicated["stages"] == whole["stages"]  # replicas alone change nothing per worker


def test_plan_json_for_7b_on_8_stages(capsys):
    status, out = plan(*SEVEN_B, "--json", capsys=capsys)
    assert status == 0
    result = json.loads(out)
    stages = result["stages"]
    assert [s["stage"] for s in stages] == list(range(8))
    assert sorted(i for s in stages for i in s["layers"]) == list(range(34))
    for s in stages:
        assert s["total_bytes"] == s["static_bytes"] + s["activation_bytes"]
        assert s["fits"] is True and s["total_bytes"] < 25e9
    assert sum(s["static_bytes"] for s in stages) == 18 * result["num_parameters"]  # ~121 GB
    assert result["bytes_per_parameter"] == {"weights": 2, "gradients": 4, "master": 4, "optimizer": 8, "total": 18}
    assert result["settings"]["amp"] == "main_weights"
    assert result["fits"] is True and result["suggestions"] == []


def test_plan_suggests_knobs_in_order_until_it_fits(capsys):
    status, out = plan("--model", "llama-7b", "--stages", "2", "--micro-batches", "8", "--micro-batch-size", "4",
                       "--no-fused-attention", "--gpu-memory", "80GB", "--json", capsys=capsys)
    result = json.loads(out)
    assert status == 0 and result["fits"] is False
    knobs = [s["knob"] for s in result["suggestions"]]
    assert knobs == ["mixed precision", "activation checkpointing", "fused attention", "smaller micro-batch"]
    totals = [s["max_total_bytes"] for s in result["suggestions"]]
    assert totals == sorted(totals, reverse=True) and totals[0] < result["max_total_bytes"]
    assert [s["fits"] for s in result["suggestions"]] == [False, False, False, True]
    _, table = plan("--model", "llama-7b", "--stages", "2", "--micro-batches", "8", "--micro-batch-size", "4",
                    "--no-fused-attention", "--gpu-memory", "80GB", capsys=capsys)
    assert "does NOT fit" in table and "--precision bf16" in table


def test_plan_suggests_more_stages_or_sharding(capsys):
    status, out = plan("--model", "llama-7b", "--stages", "1", "--micro-batches", "64", "--precision", "bf16",
                       "--activation-checkpoint", "always", "--gpu-memory", "48GB", "--json", capsys=capsys)
    result = json.loads(out)
    assert status == 0 and result["fits"] is False
    [more] = result["suggestions"]
    assert more["knob"] == "more stages" and more["flags"] == "--stages 4" and more["fits"]
    # no sharding fits 48 GB: the bf16 compute weights and fp32 main gradients (6 B/param) stay whole
    assert "alternative" not in more
    status, out = plan("--model", "llama-7b", "--stages", "1", "--micro-batches", "64", "--precision", "bf16",
                       "--activation-checkpoint", "always", "--gpu-memory", "80GB", "--json", capsys=capsys)
    [more] = json.loads(out)["suggestions"]
    assert more["flags"] == "--stages 2"
    assert ("shard the optimizer state and main weights over 8 data-parallel replicas (--replicas 8 "
            "--shard-optimizer)") in more["alternative"]


def test_plan_suggests_offload_when_kept_inputs_dominate(capsys):
    # one block per stage (4.5 GB held once offloaded), but 256 kept inputs of 33.5 MB each (8.6 GB)
    _status, out = plan("--model", "llama-7b", "--stages", "34", "--micro-batches", "256", "--precision", "bf16",
                       "--activation-checkpoint", "always", "--gpu-memory", "8GB", "--json", capsys=capsys)
    result = json.loads(out)
    assert [s["knob"] for s in result["suggestions"]] == ["activation offload"]
    assert result["suggestions"][0]["fits"] and result["suggestions"][0]["max_total_bytes"] < 10e9


def test_plan_errors(capsys):
    status, out = plan("--model", "tiny", "--stages", "9", capsys=capsys)
    assert status == 2 and "only 6 layers" in out
    status, out = plan("--model", "tiny", "--seq-len", "1000", capsys=capsys)
    assert status == 2 and "max_seq_len=256" in out
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpu-memory", "80"])
    assert "expected a number and a unit" in capsys.readouterr().err


def test_plan_of_model_chunks_sums_each_workers_chunks(capsys):
    """--schedule zbv --virtual-stages 2: each row is a worker, its two chunks (a V: worker 0 holds the
    first and the last) described one after the other; the parameters are the model's, once."""
    args = ["--model", "llama-7b", "--stages", "4", "--micro-batches", "8", "--precision", "bf16",
            "--activation-checkpoint", "always", "--json"]
    status, out = plan(*args, "--schedule", "zbv", "--virtual-stages", "2", capsys=capsys)
    result = json.loads(out)
    assert status == 0 and result["settings"]["virtual_stages"] == 2 and result["balances"] is None
    stages = result["stages"]
    assert sorted(i for s in stages for i in s["layers"]) == list(range(34))
    assert stages[0]["layers"][0] == 0 and stages[0]["layers"][-1] == 33  # embedding and head on worker 0
    assert stages[0]["description"].startswith("embedding + ") and " | " in stages[0]["description"]
    one_chunk = json.loads(plan(*args, "--schedule", "1f1b", capsys=capsys)[1])
    assert result["num_parameters"] == one_chunk["num_parameters"]
    status, out = plan(*args[:-1], "--schedule", "interleaved_1f1b", "--virtual-stages", "2", capsys=capsys)
    assert status == 0 and "interleaved_1f1b (2 chunks a stage)" in out
    status, out = plan(*args[:-1], "--schedule", "zbv", capsys=capsys)  # --virtual-stages unset: zbv's own, 2
    assert status == 0 and "zbv (2 chunks a stage)" in out
    status, out = plan(*args[:-1], "--schedule", "zbv", "--virtual-stages", "1", capsys=capsys)
    assert status == 2 and "zbv holds exactly v=2 chunks per worker" in out


def test_parse_bytes_units():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80 GiB") == 80 * 2**30
    assert parse_bytes("1.5tb") == 1.5e12
    assert parse_bytes("512MiB") == 512 * 2**20
    for bad in ("80", "GB", "80XB", "-1GB"):
        with pytest.raises(ValueError, match=f"invalid size '{bad}': expected a number and a unit"):
            parse_bytes(bad)


def test_an_elastic_plan_is_made_at_the_fewest_replicas(capsys):
    # 32 micro-batches per replica of 4: a step of 128, which 3 replicas share as 43 + 43 + 42
    elastic = json.loads(plan(*SEVEN_B, "--replicas", "3:4", "--json", capsys=capsys)[1])
    assert elastic["settings"]["num_micro_batches"] == 43 and elastic["num_replicas"] == 4
    assert elastic["elastic"] == {"min_replicas": 3, "max_replicas": 4, "micro_batches_per_replica": 43}
    status, out = plan(*SEVEN_B, "--replicas", "1:2", "--schedule", "gpipe", capsys=capsys)
    assert status == 0 and "elastic 1-2 replicas: planned at 1, where each replica runs 64 micro-batches" in out
    fixed = json.loads(plan(*SEVEN_B, "--micro-batches", "64", "--schedule", "gpipe", "--json", capsys=capsys)[1])
    one_of_two = json.loads(plan(*SEVEN_B, "--replicas", "1:2", "--schedule", "gpipe", "--json", capsys=capsys)[1])
    assert one_of_two["stages"] == fixed["stages"]  # under gpipe a stage holds every micro-batch it runs
    # ZeRO-1: the largest optimizer part is a worker's at MIN
    sharded = json.loads(plan(*SEVEN_B, "--replicas", "3:4", "--shard-optimizer", "--json", capsys=capsys)[1])
    fixed = json.loads(plan(*SEVEN_B, "--replicas", "3", "--micro-batches", "43", "--shard-optimizer", "--json",
                            capsys=capsys)[1])
    assert sharded["stages"] == fixed["stages"] and sharded["settings"]["optimizer_shards"] == 3
    status, out = plan(*SEVEN_B, "--replicas", "3:4", "--shard-optimizer", capsys=capsys)
    assert status == 0 and "each worker keeps 1/3 of its stage's optimizer state there" in out
