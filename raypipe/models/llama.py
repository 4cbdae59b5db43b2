"""A LLaMA-style decoder as a list of pipeline layers.

In the spirit of nanoGPT: token embedding, ``n_layers`` blocks (RMSNorm, causal
self-attention with rotary position embeddings, SwiGLU MLP, residuals), final
RMSNorm and LM head, with the configs and named presets. Every layer takes one
tensor and returns one tensor, so any contiguous run of them is a pipeline
stage: ``llama_layers(config)`` gives the list as :class:`~raypipe.LayerSpec`.

The rotary tables (built once per process and shared by every block, Llama 3.1's
frequency scaling) are :mod:`raypipe.models.rotary`; the attention kernel (flash-attn
or SDPA, and what each path promises about determinism) is :mod:`raypipe.models.attention`.

Packed micro-batches (:mod:`raypipe.core.packed`, from a dataset prepared with
``pack=True``): the embedding takes the ``(B, 3, T)`` tensor of tokens, positions and
document ids and returns ``(hidden, positions, document_ids)``, which the blocks pass
on; each block rotates by the per-token positions and attends only inside each
document (:mod:`raypipe.models.document_mask`); the head returns the logits. Between
stages the tuple crosses the boundary as a tree (:mod:`raypipe.stage.boundary`): the
hidden states take a gradient, the positions and document ids go forward only.

Tensor parallelism (:mod:`raypipe.models.tensor_parallel`): each layer's spec carries its
plan (:func:`llama_tp_plan`), Megatron's split: attention q/k/v and the MLP's gate and up
projections column-parallel (each rank its ``heads / t`` query heads, ``kv_heads / t`` KV
heads and ``ffn_dim / t`` hidden units), the attention's and MLP's output projections
row-parallel; the embedding row-parallel over the vocabulary (why, and what it costs:
:func:`llama_tp_plan`) and the head's output projection column-parallel, its logits a
``Shard(-1)`` DTensor for vocabulary-parallel cross entropy (:func:`llama_loss`). Under sequence parallelism the RMSNorms and the
residual stream work on sequence shards, and each attention and MLP gathers the sequence
first and reduce-scatters its output. The attention derives its local head counts from
its projections' local widths, so rotary embeddings and the packed-document masks run
unchanged on the local heads (the positions and document ids travel whole).
"""
from __future__ import annotations

import functools
import math
import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from raypipe.core.packed import IGNORE_INDEX, is_packed, split_packed
from raypipe.models.attention import causal_attention
from raypipe.models.document_mask import document_attention
from raypipe.models.layers import LayerSpec
from raypipe.models.llama_config import CONFIGS, LlamaConfig, get_config, num_parameters  # noqa: F401 (re-exported)
from raypipe.models.llama_costs import llama_layer_costs
from raypipe.models.rotary import apply_rotary, rotary_at_positions, shared_rotary_tables

if TYPE_CHECKING:  # DTensor's import takes half a second: only runs that split layers pay it
    from torch.distributed.tensor.parallel import ParallelStyle

# targets with IGNORE_INDEX (-100) count neither in the loss nor in its mean
Documents = tuple[torch.Tensor, torch.Tensor]  # packed: per-token (positions, document ids), each (B, T)


# -- building blocks ---------------------------------------------------------------

def _init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with rotary embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.num_kv_heads, config.head_dim
        self.max_seq_len = config.max_seq_len
        self.rope_theta, self.rope_scaling = config.rope_theta, config.rope_scaling
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def rotary(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The (max_seq_len, head_dim/2) fp32 cos and sin tables on ``device`` (default: the
        weights'), shared with every block of the same shape in this process."""
        device = self.wq.weight.device if device is None else device
        return shared_rotary_tables(self.head_dim, self.max_seq_len, self.rope_theta, self.rope_scaling, device)

    @property
    def rope_cos(self) -> torch.Tensor:
        return self.rotary()[0]

    @property
    def rope_sin(self) -> torch.Tensor:
        return self.rotary()[1]

    def tensor_parallel_divisors(self) -> dict[str, int]:
        """What a tensor-parallel degree must divide: each rank attends with whole heads."""
        return {"heads": self.n_heads, "KV heads": self.n_kv_heads}

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """Causal attention over ``x`` (B, T, dim); with ``documents`` (packed rows: per-token
        positions and document ids) rotary at those positions and attention inside each document.

        The head counts come from the projections' outputs: under tensor parallelism each
        rank's column-parallel q/k/v give its local heads (``n_heads / t``, ``n_kv_heads / t``)."""
        batch, seq_len, _ = x.shape
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds the model's max_seq_len={self.max_seq_len}")
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        if documents is not None:
            cos, sin = rotary_at_positions(documents[0], self.head_dim, self.rope_theta, self.rope_scaling)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        else:
            cos, sin = self.rotary(q.device)
            # copies of the first seq_len rows, so what autograd saves is seq_len rows in every
            # precision, never a view pinning the whole shared table (the memory model counts so)
            cos, sin = cos[:seq_len].to(q.dtype, copy=True), sin[:seq_len].to(q.dtype, copy=True)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = causal_attention(q, k, v) if documents is None else document_attention(q, k, v, documents[1])
        return self.wo(out.reshape(batch, seq_len, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def tensor_parallel_divisors(self) -> dict[str, int]:
        """What a tensor-parallel degree must divide: each rank its slice of the hidden units."""
        return {"FFN width": self.w1.out_features}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# -- the pipeline layers -----------------------------------------------------------

class LlamaEmbedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, dim); a packed micro-batch (B, 3, T) ->
    ``(hidden, positions, document_ids)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = config.vocab_size, config.max_seq_len
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        nn.init.normal_(self.tokens.weight, mean=0.0, std=0.02)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if is_packed(token_ids):
            tokens, positions, document_ids = split_packed(token_ids)
            return self._embed(tokens), positions, document_ids
        return self._embed(token_ids)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if token_ids.dtype not in (torch.int64, torch.int32) or token_ids.dim() != 2:
            raise ValueError(f"LlamaEmbedding expects token ids of shape (batch, seq_len) and dtype "
                             f"int64/int32, got shape {tuple(token_ids.shape)} and {token_ids.dtype}")
        if token_ids.size(1) > self.max_seq_len:
            raise ValueError(f"sequence length {token_ids.size(1)} exceeds the model's max_seq_len={self.max_seq_len}")
        if token_ids.numel():
            # both bounds in one read: on a GPU each read waits for the device's queue (a host sync)
            low, high = torch.stack(torch.aminmax(token_ids)).tolist()
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self.tokens(token_ids)


class LlamaBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)), with dropout on both branches when configured."""

    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = SwiGLU(config)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        # GPT-2 init: residual projections scaled down with depth, so the residual
        # stream's variance does not grow with the number of blocks
        std = 0.02
        for linear in (self.attention.wq, self.attention.wk, self.attention.wv,
                       self.feed_forward.w1, self.feed_forward.w3):
            _init_linear(linear, std)
        for linear in (self.attention.wo, self.feed_forward.w2):
            _init_linear(linear, std / math.sqrt(2 * config.n_layers))

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if isinstance(x, tuple):  # packed: (hidden, positions, document_ids), passed on
            hidden, *documents = x
            return (self._forward(hidden, tuple(documents)), *documents)
        return self._forward(x, None)

    def _forward(self, x: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), documents))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class LlamaHead(nn.Module):
    """Hidden states (B, T, dim), or packed ``(hidden, positions, document_ids)`` -> logits (B, T, vocab_size)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        _init_linear(self.output, 0.02)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        if isinstance(x, tuple):
            x = x[0]
        return self.output(self.norm(x))


LLAMA_LAYER_KINDS = ("embedding", "block", "head")


def llama_tp_plan(layer_kind: str, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of one LLaMA layer (``"embedding"``, ``"block"`` or ``"head"``):
    the dict ``parallelize_module`` takes, keyed by names inside the layer.

    Layers take and return local tensors: sequence shards (``Shard(1)``) under
    ``sequence_parallel``, whole activations otherwise; the head returns its logits as a
    ``Shard(-1)`` DTensor (the vocabulary split) for :func:`llama_loss`.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sequence = Shard(1) if sequence_parallel else Replicate()  # the activations between layers
    if layer_kind == "embedding":
        # Row-parallel (each rank a slice of the vocabulary's rows), not column-parallel (a slice
        # of dim): the lookup's partial sums go straight into the next layer's layout in one
        # collective, a reduce-scatter onto sequence shards (or an all-reduce), where a column
        # split's Shard(-1) output needs a re-shard onto the sequence (an all-to-all; gloo has
        # none, so DTensor all-gathers and cuts); the vocabulary is split as the head's output
        # projection splits it, unevenly where it must be (259 at t = 2: 130 + 129 rows).
        # Its cost in torch 2.13: DTensor has no row-sharded strategy for the embedding's
        # backward, so the table's gradient is computed whole and replicated on every rank
        # ((vocab, dim): 8.4 GB in fp32 at Llama 3 405B) until redistribute_gradients cuts it to
        # the rank's rows; a column-parallel plan, ColwiseParallel(input_layouts=Replicate(),
        # output_layouts=sequence), gets its own (vocab, dim / t) gradient slice directly.
        return {"tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence)}
    if layer_kind == "block":
        # the attention and MLP take the whole sequence as a DTensor, so the gradients of
        # their column-parallel projections' inputs sum before one collective, not one each
        plan: dict[str, ParallelStyle] = {
            "attention": PrepareModuleInput(input_layouts=(sequence, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=sequence),
            "feed_forward": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=sequence),
        }
        if sequence_parallel:  # the norms run on sequence shards (whole, they need no plan)
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        return plan
    if layer_kind == "head":
        plan = {"output": ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False)}
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        return plan
    raise ValueError(f"unknown LLaMA layer kind {layer_kind!r}; the kinds are {LLAMA_LAYER_KINDS}")


def llama_layers(config: LlamaConfig | str, *, seq_len: int | None = None, precision: str = "fp32",
                 fused_attention: bool = True) -> list[LayerSpec]:
    """The model as pipeline layers: embedding, ``n_layers`` blocks, head.

    Each spec carries its :class:`~raypipe.models.layers.LayerCost` for one sequence of
    ``seq_len`` tokens (default: ``max_seq_len``) in ``precision``
    (:mod:`raypipe.models.llama_costs`), which ``PipelineConfig(balance="time")`` uses,
    and its tensor-parallel plan, :func:`llama_tp_plan` of its kind as a function of
    ``sequence_parallel``.
    """

    if isinstance(config, str):
        config = get_config(config)
    specs = ([LayerSpec(LlamaEmbedding, config, tp_plan=functools.partial(llama_tp_plan, "embedding"))]
             + [LayerSpec(LlamaBlock, config, layer_id, tp_plan=functools.partial(llama_tp_plan, "block"))
                for layer_id in range(config.n_layers)]
             + [LayerSpec(LlamaHead, config, tp_plan=functools.partial(llama_tp_plan, "head"))])
    costs = llama_layer_costs(config, seq_len, precision, fused_attention)
    return [spec.with_cost(cost) for spec, cost in zip(specs, costs)]


def llama_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the targets that are not ``IGNORE_INDEX`` (-100).

    Under tensor parallelism ``logits`` is the head's ``Shard(-1)`` DTensor: the loss is
    then vocabulary-parallel (the logits never gathered whole), which needs the stage's
    :func:`~raypipe.models.tensor_parallel.loss_parallel_scope` around the forward and the
    backward, and comes back as a plain tensor, whole on every rank."""
    dtensors = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (and none is paid for)
    if dtensors is None or not isinstance(logits, dtensors.DTensor):
        return _cross_entropy(logits, targets)
    from raypipe.models.tensor_parallel import local_loss, loss_parallel_active

    if not loss_parallel_active():
        raise RuntimeError("llama_loss got DTensor logits outside raypipe.models.tensor_parallel."
                           "loss_parallel_scope(): vocabulary-parallel cross entropy needs that scope around "
                           "the loss's forward and its backward (the last stage's whole step)")
    return local_loss(_cross_entropy(logits, targets))


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def __getattr__(name: str):
    # The Hugging Face interop builds on this module, not the other way (docs/architecture.md, "Layer order").
    if name == "from_pretrained":
        raise ImportError("raypipe.models.llama.from_pretrained is now raypipe.models.hf.from_pretrained")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
