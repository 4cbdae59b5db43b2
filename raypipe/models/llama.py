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
"""
from __future__ import annotations

import math

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

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """Causal attention over ``x`` (B, T, dim); with ``documents`` (packed rows: per-token
        positions and document ids) rotary at those positions and attention inside each document."""
        batch, seq_len, _ = x.shape
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds the model's max_seq_len={self.max_seq_len}")
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
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


def llama_layers(config: LlamaConfig | str, *, seq_len: int | None = None, precision: str = "fp32",
                 fused_attention: bool = True) -> list[LayerSpec]:
    """The model as pipeline layers: embedding, ``n_layers`` blocks, head.

    Each spec carries its :class:`~raypipe.models.layers.LayerCost` for one sequence of
    ``seq_len`` tokens (default: ``max_seq_len``) in ``precision``
    (:mod:`raypipe.models.llama_costs`), which ``PipelineConfig(balance="time")`` uses.
    """

    if isinstance(config, str):
        config = get_config(config)
    specs = ([LayerSpec(LlamaEmbedding, config)]
             + [LayerSpec(LlamaBlock, config, layer_id) for layer_id in range(config.n_layers)]
             + [LayerSpec(LlamaHead, config)])
    costs = llama_layer_costs(config, seq_len, precision, fused_attention)
    return [spec.with_cost(cost) for spec, cost in zip(specs, costs)]


def llama_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the targets that are not ``IGNORE_INDEX`` (-100)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def __getattr__(name: str):
    # The Hugging Face interop builds on this module, not the other way (docs/architecture.md, "Layer order").
    if name == "from_pretrained":
        raise ImportError("raypipe.models.llama.from_pretrained is now raypipe.models.hf.from_pretrained")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
