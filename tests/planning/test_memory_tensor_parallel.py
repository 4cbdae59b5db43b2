"""The memory model with tensor parallelism inside a stage (t ranks per stage): what one rank holds.

The parameters are counted independently of the model's formula: each parameter of the built
layers (on the meta device) cut as the LLaMA's plan cuts it (q/k/v and gate/up by output rows,
o and down by input columns, the embedding and the head over the vocabulary, the RMSNorms
whole), by ``torch.chunk``, which DTensor's ``Shard`` follows (the first ranks get the larger
pieces of an uneven vocabulary).
"""
from __future__ import annotations

import pytest
import torch

from raypipe.errors import ConfigError
from raypipe.models.llama import get_config, llama_layers
from raypipe.models.llama_memory import (activation_breakdown, layer_gradient_counts, layer_parameter_counts,
                                         replicated_activation_breakdown, stage_input_bytes)
from raypipe.planning.memory import estimate_pipeline, estimate_stage, static_bytes_per_parameter

TINY = get_config("tiny")  # vocabulary 259: uneven at t = 2 (130 + 129) and t = 4 (65 * 3 + 64)
GQA = TINY.replace(n_heads=8, n_kv_heads=4)  # grouped-query attention: kv_dim = dim / 2
BATCH, SEQ_LEN = 2, 64
KINDS = ("embedding", "block", "head", "loss")
SHARDED_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1, "tokens": 0, "output": 0}


def largest_shard(name: str, parameter: torch.Tensor, t: int) -> int:
    """Elements of ``parameter`` on the tensor-parallel rank holding the most of it."""
    module = name.split(".")[-2]
    if module not in SHARDED_DIM:
        assert "norm" in module, name  # the only parameters the plan leaves whole
        return parameter.numel()
    return max(piece.numel() for piece in torch.chunk(parameter, t, dim=SHARDED_DIM[module]))


def reference_counts(config, t: int) -> tuple[list[int], list[int]]:
    """Per layer: (sharded elements on the largest rank, replicated elements), from the built layers."""
    sharded, whole = [], []
    for spec in llama_layers(config):
        parameters = dict(spec.build("meta").named_parameters())
        sharded.append(sum(largest_shard(name, p, t) for name, p in parameters.items() if "norm" not in name))
        whole.append(sum(p.numel() for name, p in parameters.items() if "norm" in name))
    return sharded, whole


@pytest.mark.parametrize("config", [TINY, GQA], ids=["tiny", "gqa"])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_parameters_per_rank_are_a_tth_of_the_sharded_and_the_replicated_whole(config, t):
    sharded, whole = reference_counts(config, t)
    assert layer_parameter_counts(config, tensor_parallel=t) == [s + w for s, w in zip(sharded, whole)]
    full, _ = reference_counts(config, 1)
    for layer in range(1, config.n_layers + 1):  # the blocks: every sharded width divides by t
        assert sharded[layer] * t == full[layer]
    vocab_rows = -(-config.vocab_size // t)  # the embedding and the head: ceil(V / t) rows on the largest rank
    assert sharded[0] == sharded[-1] == vocab_rows * config.dim
    # the gradients too, but the embedding's: torch leaves it whole until the step cuts it to the rank's rows
    gradients = layer_gradient_counts(config, tensor_parallel=t)
    assert gradients[1:] == layer_parameter_counts(config, tensor_parallel=t)[1:]
    assert gradients[0] == (config.vocab_size if t > 1 else vocab_rows) * config.dim


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("optimizer_shards", [1, 2])
def test_static_bytes_are_one_ranks_weights_gradients_main_weights_and_optimizer_state(precision, t,
                                                                                       optimizer_shards):
    sharded, whole = reference_counts(TINY, t)
    per_param = static_bytes_per_parameter(precision)
    embedding_gradient = (TINY.vocab_size - -(-TINY.vocab_size // t)) * TINY.dim  # held whole: the rows beyond
    for first, last in [(0, 2), (3, TINY.n_layers + 1)]:
        stage = estimate_stage(TINY, range(first, last + 1), num_micro_batches=4, micro_batch_size=BATCH,
                               seq_len=SEQ_LEN, precision=precision, tensor_parallel=t,
                               optimizer_shards=optimizer_shards)
        count = sum(sharded[first:last + 1]) + sum(whole[first:last + 1])
        assert stage.num_parameters == count
        assert stage.parameters_bytes == count * per_param.weights
        assert stage.gradients_bytes == (count + (embedding_gradient if first == 0 else 0)) * per_param.gradients
        assert stage.master_bytes == -(-count * per_param.master // optimizer_shards)
        assert stage.optimizer_bytes == -(-count * per_param.optimizer // optimizer_shards)


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision, amp", [("fp32", None), ("bf16", None), ("bf16", "autocast")])
@pytest.mark.parametrize("fused", [True, False])
def test_each_saved_tensor_is_a_tth_or_named_whole(sequence_parallel, kind, precision, amp, fused):
    """Every tensor of a layer's breakdown at t = 2 is either one of the parts every rank holds
    whole (the same bytes as at t = 1) or half of its t = 1 size (over the vocabulary: ceil(V / 2))."""
    config = TINY.replace(dropout=0.1)
    shape = (config, kind, BATCH, SEQ_LEN, precision, fused)
    one = activation_breakdown(*shape, amp=amp)
    two = activation_breakdown(*shape, amp=amp, tensor_parallel=2, sequence_parallel=sequence_parallel)
    whole = replicated_activation_breakdown(*shape, amp=amp, tensor_parallel=2, sequence_parallel=sequence_parallel)
    assert two.keys() == one.keys() and whole.keys() <= two.keys()
    for name, size in two.items():
        if name in whole:
            assert size == one[name], name
        elif name in ("log_probs", "output.weight_copy0"):  # the vocabulary's columns
            assert size == one[name] // config.vocab_size * -(-config.vocab_size // 2)
        else:
            assert size * 2 == one[name], name


def test_the_parts_that_stay_whole_are_named():
    sp = {"tensor_parallel": 2, "sequence_parallel": True}
    no_sp = {"tensor_parallel": 2, "sequence_parallel": False}
    # under sequence parallelism the column-parallel linears keep the all-gathered sequence
    assert set(replicated_activation_breakdown(TINY, "block", BATCH, SEQ_LEN, **sp)) == {
        "qkv.input", "rotary_tables", "w1_w3.input"}
    assert set(replicated_activation_breakdown(TINY, "head", BATCH, SEQ_LEN, **sp)) == {"output.input"}
    assert set(replicated_activation_breakdown(TINY, "embedding", BATCH, SEQ_LEN, **sp)) == {"token_ids"}
    assert set(replicated_activation_breakdown(TINY, "loss", BATCH, SEQ_LEN, **sp)) == {"targets", "total_weight"}
    # without it the norms (and dropout masks) run on the whole sequence on every rank
    assert set(replicated_activation_breakdown(TINY.replace(dropout=0.1), "block", BATCH, SEQ_LEN, **no_sp)) == {
        "qkv.input", "rotary_tables", "w1_w3.input", "attention_norm.input", "attention_norm.rstd",
        "attention_norm.normalized", "ffn_norm.input", "ffn_norm.rstd", "ffn_norm.normalized",
        "attention_dropout.mask", "mlp_dropout.mask"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("activation_checkpoint", ["never", "always"])
def test_sequence_parallel_holds_strictly_less_on_every_stage(schedule, activation_checkpoint):
    config = get_config("llama-1b")
    common = {"num_stages": 4, "num_micro_batches": 8, "micro_batch_size": 1, "seq_len": 2048,
              "precision": "bf16", "activation_checkpoint": activation_checkpoint, "schedule": schedule}
    one = estimate_pipeline(config, **common)
    without = estimate_pipeline(config, **common, tensor_parallel=2, sequence_parallel=False)
    with_sp = estimate_pipeline(config, **common, tensor_parallel=2)  # None: on at t > 1
    four = estimate_pipeline(config, **common, tensor_parallel=4)
    for stages in zip(one, without, with_sp, four):
        assert [s.activation_bytes for s in stages] == sorted((s.activation_bytes for s in stages), reverse=True)
        assert len({s.activation_bytes for s in stages}) == 4, [s.activation_bytes for s in stages]
        assert stages[0].static_bytes > stages[1].static_bytes == stages[2].static_bytes > stages[3].static_bytes


def test_a_stage_input_is_a_sequence_shard_under_sequence_parallel():
    hidden = stage_input_bytes(TINY, 1, BATCH, SEQ_LEN, "bf16")
    assert stage_input_bytes(TINY, 1, BATCH, SEQ_LEN, "bf16", tensor_parallel=4) * 4 == hidden
    assert stage_input_bytes(TINY, 1, BATCH, SEQ_LEN, "bf16", tensor_parallel=4, sequence_parallel=False) == hidden
    tokens = stage_input_bytes(TINY, 0, BATCH, SEQ_LEN)
    assert stage_input_bytes(TINY, 0, BATCH, SEQ_LEN, tensor_parallel=4) == tokens  # token ids: whole


def test_one_rank_is_the_model_without_tensor_parallelism():
    common = {"num_stages": 2, "num_micro_batches": 4, "micro_batch_size": BATCH, "seq_len": SEQ_LEN,
              "precision": "bf16", "schedule": "1f1b"}
    before = [stage.to_dict() for stage in estimate_pipeline(TINY, **common)]
    assert [stage.to_dict() for stage in estimate_pipeline(TINY, **common, tensor_parallel=1)] == before
    # sequence parallel over one rank splits nothing
    assert [stage.to_dict() for stage in estimate_pipeline(TINY, **common, sequence_parallel=True)] == before


def test_bad_tensor_parallel_arguments_are_named():
    with pytest.raises(ConfigError, match=r"^invalid tensor_parallel=3: must divide the model's n_heads=4"):
        estimate_pipeline(TINY, 2, 4, BATCH, SEQ_LEN, tensor_parallel=3)
    with pytest.raises(ConfigError, match=r"^invalid tensor_parallel=4: .*n_kv_heads=2"):
        layer_parameter_counts(TINY.replace(n_kv_heads=2, ffn_dim=352), tensor_parallel=4)
    with pytest.raises(ConfigError, match=r"^invalid tensor_parallel=0"):
        activation_breakdown(TINY, "block", BATCH, SEQ_LEN, tensor_parallel=0)
    with pytest.raises(ConfigError, match=r"^invalid sequence_parallel='yes'"):
        estimate_stage(TINY, [1], num_micro_batches=1, micro_batch_size=1, seq_len=8, tensor_parallel=2,
                       sequence_parallel="yes")
