"""Bytes of one LLaMA layer: activations it saves for one micro-batch, op by op, and
the static bytes per parameter of each precision.

What autograd saves for backward (distinct storages, parameters excluded), as
:mod:`raypipe.models.llama` runs its ops; :mod:`raypipe.planning.memory` multiplies it
out per stage and schedule, and :mod:`raypipe.models.llama_costs` puts it in each
layer's :class:`~raypipe.models.layers.LayerCost`. It lives beside the model (not in
``planning/``) so that ``llama_layers`` can attach costs: one formula for both.
A stage's bf16 compute weights count as parameters (static memory): every
micro-batch's graph saves the same copy. With tensor parallelism each figure is one
rank's, the rank holding the most, under the LLaMA's plan (``llama_tp_plan``).
"""
from __future__ import annotations

from dataclasses import dataclass

from raypipe.config import PRECISIONS
from raypipe.core.validation import check_bool, check_choice, check_positive_int
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
                         amp: str | None = None, device: str = "cuda", tensor_parallel: int = 1,
                         sequence_parallel: bool | None = None) -> dict[str, int]:
    """Bytes autograd saves for one micro-batch in one layer, by tensor.

    ``layer_kind``: "embedding", "block", "head", or "loss" (the cross entropy
    the last stage computes on the head's logits, in fp32). ``fused_attention``:
    a fused kernel (flash-attn, torch's flash/efficient SDPA) saves Q, K, V, the
    output and the softmax log-sum-exp; the unfused math path saves the
    (b, heads, s, s) probabilities instead. ``device`` matters for dropout
    masks: CUDA saves a 1-byte mask, CPU a mask in the activation dtype.

    ``tensor_parallel`` > 1: what one of the stage's tensor-parallel ranks saves (the
    one holding the most), under the LLaMA's plan (attention and MLP on local heads
    and local FFN columns, the logits and their log-softmax on local vocabulary
    columns); with ``sequence_parallel`` (None: on when ``tensor_parallel`` > 1) the
    norms and dropout masks on a sequence shard too. The parts every rank holds whole
    are :func:`replicated_activation_breakdown`'s.
    """
    return dict(_saved(config, layer_kind, micro_batch_size, seq_len, precision, fused_attention, amp, device,
                       tensor_parallel, sequence_parallel))


def replicated_activation_breakdown(config: LlamaConfig, layer_kind: str, micro_batch_size: int, seq_len: int,
                                    precision: str = "fp32", fused_attention: bool = True, *,
                                    amp: str | None = None, device: str = "cuda", tensor_parallel: int = 1,
                                    sequence_parallel: bool | None = None) -> dict[str, int]:
    """The part of :func:`activation_breakdown` that every tensor-parallel rank holds whole,
    at any ``tensor_parallel``: the token ids and targets, the rotary tables, and the input
    of each column-parallel linear (q/k/v's, gate/up's, the head's; under sequence parallel
    the all-gathered sequence, which autograd keeps for those linears' weight gradients);
    without sequence parallel also the norms' tensors and the dropout masks."""
    saved = _saved(config, layer_kind, micro_batch_size, seq_len, precision, fused_attention, amp, device,
                   tensor_parallel, sequence_parallel)
    return {name: size for name, size in saved.items() if name in saved.whole}


@dataclass(frozen=True)
class _Sharding:
    """How one tensor-parallel rank holds a layer: split ``ways`` ways, and along the
    sequence outside the sharded linears when ``sequence``."""

    ways: int
    sequence: bool

    def part(self, size: int) -> int:
        """The largest piece of ``size`` split ``ways`` ways: DTensor's uneven ``Shard``
        (``torch.chunk``'s) gives the first ranks ceil(size / ways)."""
        return -(-size // self.ways)

    def tokens(self, batch: int, seq_len: int) -> int:
        """Tokens of the sequence-sharded path (norms, residual, dropout, stage boundary)."""
        return batch * (self.part(seq_len) if self.sequence else seq_len)


def _sharding(config: LlamaConfig, tensor_parallel: int, sequence_parallel: bool | None) -> _Sharding:
    check_positive_int("tensor_parallel", tensor_parallel)
    if sequence_parallel is not None:
        check_bool("sequence_parallel", sequence_parallel)
    if any(size % tensor_parallel for size in (config.n_heads, config.num_kv_heads, config.ffn_dim)):
        raise ConfigError("tensor_parallel", tensor_parallel,
                          f"must divide the model's n_heads={config.n_heads}, n_kv_heads={config.num_kv_heads} "
                          f"and ffn_dim={config.ffn_dim} (attention and the MLP are sharded by heads and columns)")
    return _Sharding(tensor_parallel, tensor_parallel > 1 if sequence_parallel is None else sequence_parallel)


class _Saved(dict):
    """Bytes saved for backward by tensor name, and the names every tensor-parallel rank holds whole."""

    def __init__(self) -> None:
        super().__init__()
        self.whole: set[str] = set()

    def add(self, name: str, size: int, *, whole: bool) -> None:
        self[name] = size
        if whole:
            self.whole.add(name)


def _saved(config: LlamaConfig, layer_kind: str, micro_batch_size: int, seq_len: int, precision: str,
           fused_attention: bool, amp: str | None, device: str, tensor_parallel: int,
           sequence_parallel: bool | None) -> _Saved:
    check_choice("layer_kind", layer_kind, LAYER_KINDS)
    check_positive_int("micro_batch_size", micro_batch_size)
    check_positive_int("seq_len", seq_len)
    if seq_len > config.max_seq_len:
        raise ConfigError("seq_len", seq_len, f"exceeds the model's max_seq_len={config.max_seq_len}")
    dt, shards = _dtypes(precision, amp), _sharding(config, tensor_parallel, sequence_parallel)
    tokens, saved = micro_batch_size * seq_len, _Saved()
    if layer_kind == "embedding":
        saved.add("token_ids", INDEX * tokens, whole=True)  # a row-parallel embedding takes every token
    elif layer_kind == "loss":
        # loss parallel: each rank's log-softmax of its vocabulary columns, never gathered whole
        saved.add("log_probs", FP32 * tokens * shards.part(config.vocab_size), whole=False)
        saved.add("targets", INDEX * tokens, whole=True)
        saved.add("total_weight", FP32, whole=True)
    elif layer_kind == "head":
        _rms_norm(saved, "norm", config.dim, micro_batch_size, seq_len, dt, shards)
        _linears(saved, "output", [(config.dim, shards.part(config.vocab_size))], tokens, dt, dt.norm_output)
    else:
        _block(saved, config, micro_batch_size, seq_len, dt, fused_attention, device, shards)
    return saved


def _rms_norm(saved: _Saved, name: str, dim: int, batch: int, seq_len: int, dt: _Dtypes, shards: _Sharding) -> None:
    # F.rms_norm is a composite op: x * rsqrt(mean(x^2) + eps) * weight saves
    # its input, the reciprocal rms, and the normalized x (for the weight's grad)
    tokens, whole = shards.tokens(batch, seq_len), not shards.sequence
    saved.add(f"{name}.input", dt.norm_input * tokens * dim, whole=whole)
    saved.add(f"{name}.rstd", FP32 * tokens, whole=whole)
    saved.add(f"{name}.normalized", dt.norm * tokens * dim, whole=whole)


def _linears(saved: _Saved, name: str, shapes: list[tuple[int, int]], tokens: int, dt: _Dtypes,
             input_bytes: int) -> None:
    """Linears fed by one tensor: they share one saved input (the producer's
    output), unless autocast casts fp32 weights (``weight_copies``): then each
    casts its own 2-byte input copy (when the producer is fp32) and its own
    2-byte weight copy, in every forward. ``shapes``: each linear's (fan_in,
    fan_out) on one tensor-parallel rank; the input (``tokens`` whole) is the
    whole sequence: column-parallel linears take it all (under sequence parallel
    all-gathered first, and autograd keeps the gathered tensor for their weight
    gradients)."""
    in_features = shapes[0][0]
    if not dt.weight_copies:
        saved.add(f"{name}.input", input_bytes * tokens * in_features, whole=True)
        return
    for index, (fan_in, fan_out) in enumerate(shapes):
        if input_bytes != dt.act:
            saved.add(f"{name}.input_copy{index}", dt.act * tokens * fan_in, whole=True)
        saved.add(f"{name}.weight_copy{index}", dt.act * fan_in * fan_out, whole=False)
    if input_bytes == dt.act:  # already low precision: one shared input
        saved.add(f"{name}.input", dt.act * tokens * in_features, whole=True)


def _block(saved: _Saved, config: LlamaConfig, batch: int, seq_len: int, dt: _Dtypes, fused: bool, device: str,
           shards: _Sharding) -> None:
    # one rank's heads and FFN columns (the sharding checked that tensor_parallel divides them)
    ways = shards.ways
    d, heads, head_dim = config.dim, config.n_heads // ways, config.head_dim
    d_local, kv, f = heads * head_dim, config.kv_dim // ways, config.ffn_dim // ways
    tokens = batch * seq_len
    _rms_norm(saved, "attention_norm", config.dim, batch, seq_len, dt, shards)
    _linears(saved, "qkv", [(d, d_local), (d, kv), (d, kv)], tokens, dt, dt.norm_output)
    # cos and sin, saved by the rotary multiplies: a copy of the shared tables' first
    # seq_len rows in the activations' dtype (in every precision, fp32 included)
    saved.add("rotary_tables", 2 * seq_len * (head_dim // 2) * dt.act, whole=True)
    if fused:
        for name, size in (("q", dt.act * tokens * d_local), ("k", dt.act * tokens * kv),
                           ("v", dt.act * tokens * kv), ("softmax_lse", FP32 * batch * heads * seq_len),
                           ("attention_out", dt.act * tokens * d_local)):  # attention_out: also wo's input
            saved.add(name, size, whole=False)
        wo_input = None
    else:
        # math path: q and k pre-scaled by sqrt(scale), k and v repeated to all heads (GQA)
        e = dt.math_attention
        for name, size in (("q_scaled", e * tokens * d_local), ("k_scaled", e * tokens * d_local),
                           ("v", e * tokens * d_local), ("attention_probs", e * batch * heads * seq_len * seq_len)):
            saved.add(name, size, whole=False)
        wo_input = dt.act * tokens * d_local  # the output, made contiguous (a copy) for wo
    if dt.weight_copies:
        saved.add("wo.weight_copy0", dt.act * d_local * d, whole=False)
    if wo_input is not None:
        saved.add("wo.input", wo_input, whole=False)
    _dropout(saved, "attention_dropout", config, batch, seq_len, dt, device, shards)
    _rms_norm(saved, "ffn_norm", d, batch, seq_len, dt, shards)
    _linears(saved, "w1_w3", [(d, f), (d, f)], tokens, dt, dt.norm_output)
    # silu saves its input (w1's output), the product saves silu's output and
    # w3's output, w2 saves the product
    for name in ("mlp.gate", "mlp.silu", "mlp.up", "mlp.product"):
        saved.add(name, dt.act * tokens * f, whole=False)
    if dt.weight_copies:
        saved.add("w2.weight_copy0", dt.act * f * d, whole=False)
    _dropout(saved, "mlp_dropout", config, batch, seq_len, dt, device, shards)


def _dropout(saved: _Saved, name: str, config: LlamaConfig, batch: int, seq_len: int, dt: _Dtypes, device: str,
             shards: _Sharding) -> None:
    if config.dropout <= 0:
        return
    mask_bytes = 1 if device == "cuda" else dt.act  # CUDA: bool mask; CPU: mask in the input dtype
    saved.add(f"{name}.mask", mask_bytes * shards.tokens(batch, seq_len) * config.dim, whole=not shards.sequence)


def estimate_layer_activation_bytes(config: LlamaConfig, layer_kind: str, micro_batch_size: int, seq_len: int,
                                    precision: str = "fp32", fused_attention: bool = True, *,
                                    amp: str | None = None, device: str = "cuda", tensor_parallel: int = 1,
                                    sequence_parallel: bool | None = None) -> int:
    """Bytes one micro-batch keeps for backward in one layer (sum of :func:`activation_breakdown`)."""
    return sum(activation_breakdown(config, layer_kind, micro_batch_size, seq_len, precision, fused_attention,
                                    amp=amp, device=device, tensor_parallel=tensor_parallel,
                                    sequence_parallel=sequence_parallel).values())


def layer_kinds(config: LlamaConfig) -> list[str]:
    """Kind of each global layer index of :func:`~raypipe.models.llama.llama_layers`."""
    return ["embedding"] + ["block"] * config.n_layers + ["head"]


def layer_parameter_counts(config: LlamaConfig, *, tensor_parallel: int = 1) -> list[int]:
    """Parameters of each global layer, from the shapes; with ``tensor_parallel`` > 1 those one
    tensor-parallel rank holds (the one holding the most): 1/t of each sharded weight (q, k, v, o,
    gate, up, down; the embedding and head over the vocabulary, ceil(V/t) rows), the RMSNorms whole."""
    shards = _sharding(config, tensor_parallel, None)
    d, kv, vocab = config.dim, config.kv_dim, shards.part(config.vocab_size)
    block = 2 * d + (2 * d * d + 2 * d * kv + 3 * d * config.ffn_dim) // tensor_parallel
    return [vocab * d] + [block] * config.n_layers + [d + d * vocab]


def layer_gradient_counts(config: LlamaConfig, *, tensor_parallel: int = 1) -> list[int]:
    """Gradient elements of each global layer that one tensor-parallel rank holds during a step:
    its parameters' (:func:`layer_parameter_counts`), except the row-parallel embedding's at
    ``tensor_parallel`` > 1, which is whole (vocabulary x dim): DTensor (torch 2.13) has no
    row-sharded strategy for the embedding's backward, so autograd leaves the table's gradient
    whole and replicated on every rank until the step cuts it to the rank's rows
    (``redistribute_gradients``, after the backwards and before the step reads them)."""
    counts = layer_parameter_counts(config, tensor_parallel=tensor_parallel)
    return counts if tensor_parallel == 1 else [config.vocab_size * config.dim] + counts[1:]


def stage_input_bytes(config: LlamaConfig, first_layer: int, micro_batch_size: int, seq_len: int,
                      precision: str = "fp32", amp: str | None = None, *, tensor_parallel: int = 1,
                      sequence_parallel: bool | None = None) -> int:
    """Bytes of a stage's input: token ids on the first stage (whole on every tensor-parallel
    rank), hidden states after (a sequence shard under sequence parallel)."""
    if first_layer == 0:
        return INDEX * micro_batch_size * seq_len
    tokens = _sharding(config, tensor_parallel, sequence_parallel).tokens(micro_batch_size, seq_len)
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
