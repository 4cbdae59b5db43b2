"""Causal attention kernel selection: flash-attn when it can run, otherwise torch's SDPA.

Attention runs flash-attn's ``flash_attn_func`` when it imports, the tensors
are CUDA bf16/fp16, head_dim is at most 256 and the card is Ampere or newer
(:func:`flash_unavailable_reason` says why not), otherwise
``torch.nn.functional.scaled_dot_product_attention`` (a CUDA run that could have
used flash-attn says once why it did not).

Determinism (raypipe promises a healed run is bitwise the uninterrupted one): the
forward is deterministic on every path; flash-attn's backward runs its deterministic
variant; on CPU SDPA is deterministic. SDPA's CUDA backward kernels (flash,
memory-efficient) sum with atomics unless ``torch.use_deterministic_algorithms(True)``
is on when the backward runs (it also needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8``), so
on GPU without flash-attn the bitwise promise holds only under that setting.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

try:  # optional: the [gpu] extra
    from flash_attn import flash_attn_func as _flash_attn_func
except (ImportError, OSError):  # not installed, or built against another CUDA/torch
    _flash_attn_func = None

FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's kernels go up to 256; it pads other sizes to a multiple of 8 itself
FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere, Ada and Hopper
# A healed run must be bitwise the uninterrupted one: flash-attn's deterministic backward
# ("slightly slower and uses more memory", its docs say) instead of its atomic one.
FLASH_DETERMINISTIC_BACKWARD = True
_fallbacks_said: set[str] = set()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(QKᵀ/√d)V on (B, T, heads, head_dim) tensors; k/v may have fewer heads (GQA)."""
    reason = flash_unavailable_reason(q)
    if reason is None:
        return _flash_attn_func(q, k, v, causal=True,  # same layout, GQA built in
                                deterministic=FLASH_DETERMINISTIC_BACKWARD)
    if _flash_attn_func is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        _say_fallback_once(f"not flash-attn, because {reason}")
    if q.is_cuda and q.requires_grad and not torch.are_deterministic_algorithms_enabled():
        _say_fallback_once("its CUDA backward is not deterministic unless torch.use_deterministic_algorithms(True) "
                           "is on, so a healed run may differ from the uninterrupted one in the last bits")
    gqa = k.size(2) != q.size(2)
    if gqa and q.is_cuda and q.dtype == torch.float32:
        # SDPA runs enable_gqa only in its flash (bf16/fp16) and math kernels: fp32 GQA would take
        # the O(T²) math kernel. With the heads expanded the memory-efficient kernel can run.
        k, v, gqa = expand_kv_heads(k, q.size(2)), expand_kv_heads(v, q.size(2)), False
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2)


def flash_unavailable_reason(q: torch.Tensor) -> str | None:
    """Why flash-attn's kernel cannot attend over ``q`` (B, T, heads, head_dim); None: it can."""
    if _flash_attn_func is None:
        return "flash-attn is not installed (or does not import)"
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"flash-attn computes in bf16/fp16, not {q.dtype}"
    if q.size(-1) > FLASH_MAX_HEAD_DIM:
        return f"head_dim {q.size(-1)} exceeds flash-attn's maximum of {FLASH_MAX_HEAD_DIM}"
    capability = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if capability < FLASH_MIN_CAPABILITY:
        return (f"the GPU's compute capability {capability[0]}.{capability[1]} is below the "
                f"{FLASH_MIN_CAPABILITY[0]}.{FLASH_MIN_CAPABILITY[1]} (Ampere) flash-attn 2 needs")
    return None


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _say_fallback_once(reason: str) -> None:
    if reason not in _fallbacks_said:
        _fallbacks_said.add(reason)
        warnings.warn(f"attention runs torch's scaled_dot_product_attention: {reason}", stacklevel=3)


def expand_kv_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, kv_heads, head_dim) -> (B, T, n_heads, head_dim), query head ``h`` reading key/value
    head ``h // (n_heads / kv_heads)``: the grouping of SDPA's ``enable_gqa`` and flash-attn."""
    return x.repeat_interleave(n_heads // x.size(2), dim=2)
