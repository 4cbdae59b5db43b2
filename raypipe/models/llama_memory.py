"""Bytes of one LLaMA layer: activations it saves for one micro-batch, op by op, and
the static bytes per parameter of each precision.

What autograd saves for backward (distinct storages, parameters excluded), as
:mod:`raypipe.models.llama` runs its ops; :mod:`raypipe.planning.memory` multiplies it
out per stage and schedule, and :mod:`raypipe.models.llama_costs` puts it in each
layer's :class:`~raypipe.models.layers.LayerCost`. It lives beside the model (not in
``planning/``) so that ``llama_layers`` can attach costs: one formula for both.
A stage's bf16 compute weights count as parameters (static memory): every
micro-batch's graph saves the same copy.
"""
from __future__ import annotations

from dataclasses import dataclass

from raypipe.config import PRECISIONS
from raypipe.core.validation import check_choice, check_positive_int
from raypipe.errors import ConfigError
from raypipe.models.llama_config import LlamaConfig


FP32 = 4
INDEX = 8  # token ids and targets are int64
LAYER_KINDS = ("embedding", "block", "head", "loss")
# How bf16/fp16 runs (fp32 has one way):
#   "main_weights": 2-byte compute weights shared by every micro-batch of a step, fp32 main
#                   weights and main gradients, forward under torch.autocast (raypipe's bf16)
#   "autocast":     fp32 weights under torch.autocast, cast again in every forward (raypipe's fp16)
#   "standard":     the common convention: 2-byte weights, gradients and activations throughout
AMP_STYLES = ("main_weights", "autocast", "standard")
RAYPIPE_AMP = {"bf16": "main_weights", "fp16": "autocast"}  # what PipelineConfig(precision=...) runs


def amp_style(precision: str, amp: str | None = None) -> str | None:
    """``amp``, or (None) the style raypipe runs for ``precision``; None for fp32."""
    check_choice("precision", precision, PRECISIONS)
    if amp is not None:
        check_choice("amp", amp, AMP_STYLES)
    return None if precision == "fp32" else amp or RAYPIPE_AMP[precision]

# -- activations per layer -----------------------------------------------------------

@dataclass(frozen=True)
class _Dtypes:
    """Element sizes of the tensors autograd saves, for one precision setting."""

    act: int  # outputs of matmuls and attention
    resid: int  # residual stream: stage boundaries
    norm_input: int  # what RMSNorm saves of its input
    norm: int  # normalized activations inside RMSNorm
    norm_output: int  # RMSNorm's output, the input the following linears save
    math_attention: int  # the unfused (math) attention path
    weight_copies: bool  # linears save low-precision copies of their input and weight, per forward
    exact_tables: bool  # fp32 rotary tables are saved as views of the whole buffer


def _dtypes(precision: str, amp: str | None) -> _Dtypes:
    style = amp_style(precision, amp)
    if style is None:
        return _Dtypes(FP32, FP32, FP32, FP32, FP32, FP32, weight_copies=False, exact_tables=True)
    if style == "standard":
        return _Dtypes(2, 2, 2, 2, 2, 2, weight_copies=False, exact_tables=False)
    # Under torch.autocast matmuls run in 2 bytes and torch's math attention upcasts
    # 2-byte inputs to fp32 (allow_fp16_bf16_reduction_math_sdp is off by default).
    if style == "autocast":
        # fp32 weights: the embedding output, the residual stream and RMSNorm stay fp32
        return _Dtypes(2, FP32, FP32, FP32, FP32, FP32, weight_copies=True, exact_tables=False)
    # main_weights: bf16 weights, so the embedding output and the residual stream are
    # 2-byte; RMSNorm computes in fp32 (it saves an fp32 copy of its input and the fp32
    # normalized x) and returns its input's dtype, one 2-byte tensor the linears share
    return _Dtypes(2, 2, FP32, FP32, 2, FP32, weight_copies=False, exact_tables=False)


def activation_breakdown(config: LlamaConfig, layer_kind: str, micro_batch_size: int, seq_len: int,
                         precision: str = "fp32", fused_attention: bool = True, *,
                         amp: str | None = None, device: str = "cuda") -> dict[str, int]:
    """Bytes autograd saves for one micro-batch in one layer, by tensor.

    ``layer_kind``: "embedding", "block", "head", or "loss" (the cross entropy
    the last stage computes on the head's logits, in fp32). ``fused_attention``:
    a fused kernel (flash-attn, torch's flash/efficient SDPA) saves Q, K, V, the
    output and the softmax log-sum-exp; the unfused math path saves the
    (b, heads, s, s) probabilities instead. ``device`` matters for dropout
    masks: CUDA saves a 1-byte mask, CPU a mask in the activation dtype.
    """
    check_choice("layer_kind", layer_kind, LAYER_KINDS)
    check_positive_int("micro_batch_size", micro_batch_size)
    check_positive_int("seq_len", seq_len)
    if seq_len > config.max_seq_len:
        raise ConfigError("seq_len", seq_len, f"exceeds the model's max_seq_len={config.max_seq_len}")
    dt = _dtypes(precision, amp)
    tokens = micro_batch_size * seq_len
    if layer_kind == "embedding":
        return {"token_ids": INDEX * tokens}
    if layer_kind == "loss":
        return {"log_probs": FP32 * tokens * config.vocab_size, "targets": INDEX * tokens, "total_weight": FP32}
    if layer_kind == "head":
        saved = _rms_norm("norm", config.dim, tokens, dt)
        saved.update(_linears("output", [(config.dim, config.vocab_size)], tokens, dt, input_bytes=dt.norm_output))
        return saved
    return _block(config, micro_batch_size, seq_len, dt, fused_attention, device)


def _rms_norm(name: str, dim: int, tokens: int, dt: _Dtypes) -> dict[str, int]:
    # F.rms_norm is a composite op: x * rsqrt(mean(x^2) + eps) * weight saves
    # its input, the reciprocal rms, and the normalized x (for the weight's grad)
    return {f"{name}.input": dt.norm_input * tokens * dim, f"{name}.rstd": FP32 * tokens,
            f"{name}.normalized": dt.norm * tokens * dim}


def _linears(name: str, shapes: list[tuple[int, int]], tokens: int, dt: _Dtypes, input_bytes: int) -> dict[str, int]:
    """Linears fed by one tensor: they share one saved input (the producer's
    output), unless autocast casts fp32 weights (``weight_copies``): then each
    casts its own 2-byte input copy (when the producer is fp32) and its own
    2-byte weight copy, in every forward."""
    in_features = shapes[0][0]
    if not dt.weight_copies:
        return {f"{name}.input": input_bytes * tokens * in_features}
    saved = {}
    for index, (fan_in, fan_out) in enumerate(shapes):
        if input_bytes != dt.act:
            saved[f"{name}.input_copy{index}"] = dt.act * tokens * fan_in
        saved[f"{name}.weight_copy{index}"] = dt.act * fan_in * fan_out
    if input_bytes == dt.act:  # already low precision: one shared input
        saved[f"{name}.input"] = dt.act * tokens * in_features
    return saved


def _block(config: LlamaConfig, batch: int, seq_len: int, dt: _Dtypes, fused: bool, device: str) -> dict[str, int]:
    d, kv, f, heads, head_dim = config.dim, config.kv_dim, config.ffn_dim, config.n_heads, config.head_dim
    tokens = batch * seq_len
    saved = _rms_norm("attention_norm", d, tokens, dt)
    saved.update(_linears("qkv", [(d, d), (d, kv), (d, kv)], tokens, dt, input_bytes=dt.norm_output))
    # cos and sin, saved by the rotary multiplies: a copy of the shared tables' first
    # seq_len rows in the activations' dtype (in every precision, fp32 included)
    saved["rotary_tables"] = 2 * seq_len * (head_dim // 2) * dt.act
    if fused:
        saved.update({"q": dt.act * tokens * d, "k": dt.act * tokens * kv, "v": dt.act * tokens * kv,
                      "softmax_lse": FP32 * batch * heads * seq_len,
                      "attention_out": dt.act * tokens * d})  # also the input of wo
        wo_input = None
    else:
        # math path: q and k pre-scaled by sqrt(scale), k and v repeated to all heads (GQA)
        e = dt.math_attention
        saved.update({"q_scaled": e * tokens * d, "k_scaled": e * tokens * d, "v": e * tokens * d,
                      "attention_probs": e * batch * heads * seq_len * seq_len})
        wo_input = dt.act * tokens * d  # the output, made contiguous (a copy) for wo
    if dt.weight_copies:
        saved["wo.weight_copy0"] = dt.act * d * d
    if wo_input is not None:
        saved["wo.input"] = wo_input
    saved.update(_dropout("attention_dropout", config, tokens, dt, device))
    saved.update(_rms_norm("ffn_norm", d, tokens, dt))
    saved.update(_linears("w1_w3", [(d, f), (d, f)], tokens, dt, input_bytes=dt.norm_output))
    # silu saves its input (w1's output), the product saves silu's output and
    # w3's output, w2 saves the product
    saved.update({"mlp.gate": dt.act * tokens * f, "mlp.silu": dt.act * tokens * f,
                  "mlp.up": dt.act * tokens * f, "mlp.product": dt.act * tokens * f})
    if dt.weight_copies:
        saved["w2.weight_copy0"] = dt.act * f * d
    saved.update(_dropout("mlp_dropout", config, tokens, dt, device))
    return saved


def _dropout(name: str, config: LlamaConfig, tokens: int, dt: _Dtypes, device: str) -> dict[str, int]:
    if config.dropout <= 0:
        return {}
    mask_bytes = 1 if device == "cuda" else dt.act  # CUDA: bool mask; CPU: mask in the input dtype
    return {f"{name}.mask": mask_bytes * tokens * config.dim}


def estimate_layer_activation_bytes(config: LlamaConfig, layer_kind: str, micro_batch_size: int, seq_len: int,
                                    precision: str = "fp32", fused_attention: bool = True, *,
                                    amp: str | None = None, device: str = "cuda") -> int:
    """Bytes one micro-batch keeps for backward in one layer (sum of :func:`activation_breakdown`)."""
    return sum(activation_breakdown(config, layer_kind, micro_batch_size, seq_len, precision,
                                    fused_attention, amp=amp, device=device).values())


def layer_kinds(config: LlamaConfig) -> list[str]:
    """Kind of each global layer index of :func:`~raypipe.models.llama.llama_layers`."""
    return ["embedding"] + ["block"] * config.n_layers + ["head"]


def layer_parameter_counts(config: LlamaConfig) -> list[int]:
    """Parameters of each global layer, from the shapes."""
    d, kv = config.dim, config.kv_dim
    block = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * config.ffn_dim
    return [config.vocab_size * d] + [block] * config.n_layers + [d + d * config.vocab_size]


def stage_input_bytes(config: LlamaConfig, first_layer: int, micro_batch_size: int, seq_len: int,
                      precision: str = "fp32", amp: str | None = None) -> int:
    """Bytes of a stage's input: token ids on the first stage, hidden states after."""
    tokens = micro_batch_size * seq_len
    if first_layer == 0:
        return INDEX * tokens
    return _dtypes(precision, amp).resid * tokens * config.dim


# -- static bytes per parameter ------------------------------------------------------

@dataclass(frozen=True)
class StaticBytes:
    """Bytes per parameter of one precision setting with Adam (moments in fp32)."""

    weights: int
    gradients: int
    master: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.master + self.optimizer


# per mixed-precision style (None: fp32), with Adam
STATIC_BYTES_PER_PARAMETER: dict[str | None, StaticBytes] = {
    None: StaticBytes(weights=4, gradients=4, master=0, optimizer=8),
    "main_weights": StaticBytes(weights=2, gradients=4, master=4, optimizer=8),
    "autocast": StaticBytes(weights=4, gradients=4, master=0, optimizer=8),
    "standard": StaticBytes(weights=2, gradients=2, master=4, optimizer=8),
}
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}  # fp32 state per parameter


def static_bytes_per_parameter(precision: str, amp: str | None = None, optimizer: str = "adam") -> StaticBytes:
    """Static bytes per parameter for a precision, mixed-precision style (None: the one
    raypipe runs, see :data:`RAYPIPE_AMP`) and optimizer."""
    check_choice("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES))
    table = STATIC_BYTES_PER_PARAMETER[amp_style(precision, amp)]
    return StaticBytes(table.weights, table.gradients, table.master, OPTIMIZER_STATE_BYTES[optimizer])
