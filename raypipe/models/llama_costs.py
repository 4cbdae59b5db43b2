"""Per-layer costs of the LLaMA layers, analytically: what ``llama_layers`` attaches to
each :class:`~raypipe.models.layers.LayerSpec` and ``balance="time"`` balances by.

Flops of one sequence of ``seq_len`` tokens: the matmuls (what MFU counts: a linear of
``n`` inputs and ``m`` outputs is ``2 n m`` per token forward, as much again for the
input's gradient and for the weight's) and the attention core; elementwise work
(norms, rotary, SiLU, residuals) is left out, except the cross entropy over the
vocabulary, which is as large as the logits. Attention: the unfused (math) path
computes all ``T x T`` scores, ``QK^T`` and ``PV`` (``4 T^2 d`` forward, twice that
backward); a fused causal kernel (flash-attn, SDPA's flash/efficient kernels) skips
the masked half (``2 T^2 d``) and its backward recomputes the scores (5 matmuls of the
half: ``5 T^2 d``). Bytes come from :mod:`raypipe.models.llama_memory`, the same
figures the memory model uses.
"""
from __future__ import annotations

from collections.abc import Sequence

from raypipe.models.layers import LayerCost, LayerSpec
from raypipe.models.llama_config import LlamaConfig
from raypipe.models.llama_memory import (_dtypes, estimate_layer_activation_bytes, layer_kinds,
                                         layer_parameter_counts, stage_input_bytes, static_bytes_per_parameter)


CROSS_ENTROPY_FWD_FLOPS = 4  # per logit: max, subtract, exp, sum (log-softmax) and the target's pick
CROSS_ENTROPY_BWD_FLOPS = 2  # per logit: softmax minus one-hot, scaled by the mean's weight


def attention_core_flops(config: LlamaConfig, seq_len: int, fused_attention: bool) -> tuple[int, int]:
    """(forward, backward) flops of softmax(QK^T)V over one causal sequence, all heads."""
    full = 2 * seq_len * seq_len * config.dim  # one T x T x d matmul over all heads
    if fused_attention:
        return full, 5 * full // 2  # causal half of QK^T and PV; backward: S again, dV, dP, dQ, dK
    return 2 * full, 4 * full  # every score computed, then masked


def llama_layer_cost(config: LlamaConfig, layer_kind: str, seq_len: int | None = None, precision: str = "fp32",
                     fused_attention: bool = True, *, amp: str | None = None, device: str = "cuda") -> LayerCost:
    """The cost of one "embedding", "block" or "head" layer (the head with the cross entropy over
    the vocabulary) for one sequence of ``seq_len`` tokens (default: the model's max_seq_len)."""
    seq_len = config.max_seq_len if seq_len is None else seq_len
    d, kv, f, vocab = config.dim, config.kv_dim, config.ffn_dim, config.vocab_size
    tokens = seq_len
    shape = {"micro_batch_size": 1, "seq_len": seq_len, "precision": precision, "amp": amp}
    saved = estimate_layer_activation_bytes(config, layer_kind, fused_attention=fused_attention, device=device,
                                            **shape)
    index = {"embedding": 0, "block": 1, "head": config.n_layers + 1}[layer_kind] if layer_kind != "loss" else None
    if index is None:
        raise ValueError("layer_kind='loss' has no layer of its own: the head's cost includes the cross entropy")
    weights = layer_parameter_counts(config)[index] * static_bytes_per_parameter(precision, amp).weights
    if layer_kind == "embedding":
        # a gather forward; the backward scatters the gradient rows into the table (no input gradient)
        return LayerCost(0, 0, tokens * d, saved_bytes=saved, param_bytes=weights,
                         output_bytes=stage_input_bytes(config, 1, **shape))
    if layer_kind == "head":
        linear = 2 * tokens * d * vocab
        logits = tokens * vocab
        loss_saved = estimate_layer_activation_bytes(config, "loss", **shape)
        return LayerCost(linear + CROSS_ENTROPY_FWD_FLOPS * logits, linear + CROSS_ENTROPY_BWD_FLOPS * logits, linear,
                         saved_bytes=saved + loss_saved, param_bytes=weights,
                         output_bytes=_dtypes(precision, amp).act * logits)
    linear = 2 * tokens * (d * (d + 2 * kv) + d * d + 3 * d * f)  # wq wk wv, wo, w1 w3 w2
    core_fwd, core_bwd = attention_core_flops(config, seq_len, fused_attention)
    return LayerCost(linear + core_fwd, linear + core_bwd, linear, saved_bytes=saved, param_bytes=weights,
                     output_bytes=stage_input_bytes(config, 1, **shape))


def llama_layer_costs(config: LlamaConfig, seq_len: int | None = None, precision: str = "fp32",
                      fused_attention: bool = True, *, amp: str | None = None, device: str = "cuda"
                      ) -> list[LayerCost]:
    """:func:`llama_layer_cost` of every layer of ``llama_layers(config)``, in order."""
    by_kind = {kind: llama_layer_cost(config, kind, seq_len, precision, fused_attention, amp=amp, device=device)
               for kind in ("embedding", "block", "head")}
    return [by_kind[kind] for kind in layer_kinds(config)]


def with_llama_costs(layers: Sequence[LayerSpec], config: LlamaConfig, seq_len: int | None = None,
                     precision: str = "fp32", fused_attention: bool = True, *, amp: str | None = None
                     ) -> list[LayerSpec]:
    """Copies of a LLaMA's layer specs (``llama_layers``, or a pretrained model's) with their costs."""
    costs = llama_layer_costs(config, seq_len, precision, fused_attention, amp=amp)
    if len(layers) != len(costs):
        raise ValueError(f"{len(layers)} layers, but the config's LLaMA has {len(costs)} (embedding, "
                         f"{config.n_layers} blocks, head)")
    return [layer.with_cost(cost) for layer, cost in zip(layers, costs)]
