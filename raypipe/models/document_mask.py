"""Attention inside each packed document: causal within a document, blocked across documents.

Packed rows (:mod:`raypipe.core.packed`) hold several documents (pieces) back to
back; ``document_ids`` (batch, T) numbers them per row. Two kernels:

- flash-attn's variable-length kernel (``flash_attn_varlen_func``) when flash-attn
  could run the tensors at all (:func:`~raypipe.models.attention.flash_unavailable_reason`):
  the batch flattened to one stream of ``batch * T`` tokens and the pieces given as
  cumulative sequence lengths, so nothing is padded or masked;
- otherwise PyTorch's ``scaled_dot_product_attention`` with a boolean block-diagonal
  causal mask ``(batch, 1, T, T)`` (O(T²) memory per sequence, as the math kernel is),
  or on CPU, where every row holds one piece, its plain causal attention (no mask).

Both have the determinism of their unpacked counterparts (the varlen backward runs
its deterministic variant).
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F

from raypipe.models import attention

try:  # optional: the [gpu] extra
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
except (ImportError, OSError):
    _flash_attn_varlen_func = None

# The boundaries of the document ids a stage's blocks were last given: every block of a
# forward gets the same ids tensor, and flash-attn needs the longest piece as a Python int
# (a device-to-host copy), so each forward computes them once, not once per block.
_last_boundaries: tuple[weakref.ref, torch.Tensor, int] | None = None
_boundaries_lock = threading.Lock()


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """softmax(QKᵀ/√d)V on (B, T, heads, head_dim) tensors, each query attending to the keys at or
    before it with its own document id; k/v may have fewer heads (GQA)."""
    if _flash_attn_varlen_func is not None and attention.flash_unavailable_reason(q) is None:
        return _varlen_attention(q, k, v, document_ids)
    if not document_ids.is_cuda and bool((document_ids == document_ids[:, :1]).all()):
        # one piece per row (most rows of long documents): plain causal attention, the fused kernel,
        # no (B, T, T) mask; on CPU only, where asking costs no device-to-host sync in every block
        return attention.causal_attention(q, k, v)
    gqa = k.size(2) != q.size(2)
    if gqa and q.is_cuda and q.dtype == torch.float32:  # as attention.causal_attention: keep off the math kernel
        k, v, gqa = attention.expand_kv_heads(k, q.size(2)), attention.expand_kv_heads(v, q.size(2)), False
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=document_causal_mask(document_ids), enable_gqa=gqa)
    return out.transpose(1, 2)


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query ``i`` may attend to key ``j``: ``j <= i`` in one document."""
    length = document_ids.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


def cumulative_lengths(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The pieces of (B, T) ``document_ids`` as flash-attn's varlen arguments over the flattened
    ``B * T`` tokens: int32 cumulative lengths ``[0, end of piece 0, ...]`` and the longest piece."""
    global _last_boundaries
    last = _last_boundaries
    if last is not None and last[0]() is document_ids:
        return last[1], last[2]
    begins = torch.ones_like(document_ids, dtype=torch.bool)
    begins[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # and every row's first token begins one
    starts = torch.nonzero(begins.reshape(-1)).reshape(-1)
    total = torch.tensor([document_ids.numel()], device=starts.device, dtype=starts.dtype)
    cumulative = torch.cat([starts, total]).to(torch.int32)
    longest = int((cumulative[1:] - cumulative[:-1]).max())
    with _boundaries_lock:
        _last_boundaries = (weakref.ref(document_ids), cumulative, longest)
    return cumulative, longest


def _varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    batch, length = q.shape[:2]
    cumulative, longest = cumulative_lengths(document_ids)
    out = _flash_attn_varlen_func(q.reshape(batch * length, *q.shape[2:]), k.reshape(batch * length, *k.shape[2:]),
                                  v.reshape(batch * length, *v.shape[2:]), cumulative, cumulative, longest, longest,
                                  causal=True, deterministic=attention.FLASH_DETERMINISTIC_BACKWARD)
    return out.reshape(batch, length, *out.shape[1:])
