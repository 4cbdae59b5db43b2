"""Which attention kernel runs, why another did not, and that the choices change no result:
the GQA head expansion against SDPA's own enable_gqa, the flash-attn guards, the
deterministic flash backward (GPU)."""
import math

import pytest
import torch
import torch.nn.functional as F

from raypipe.models import attention
from raypipe.models.attention import causal_attention, expand_kv_heads, flash_unavailable_reason


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_expanded_heads_attend_as_sdpas_grouped_query_attention(kv_heads):
    # the fp32-on-CUDA path expands k/v instead of enable_gqa: the same grouping, checked on the CPU
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64)  # (B, heads, T, d) as SDPA takes them
    k, v = torch.randn(2, kv_heads, 9, 8, dtype=torch.float64), torch.randn(2, kv_heads, 9, 8, dtype=torch.float64)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4)
    expanded = F.scaled_dot_product_attention(
        q, expand_kv_heads(k.transpose(1, 2), 4).transpose(1, 2),
        expand_kv_heads(v.transpose(1, 2), 4).transpose(1, 2), is_causal=True)
    torch.testing.assert_close(expanded, grouped, rtol=1e-12, atol=1e-12)


def test_expansion_gives_query_head_h_the_kv_head_of_its_group():
    kv = torch.arange(2.0).view(1, 1, 2, 1)  # kv heads 0 and 1
    assert expand_kv_heads(kv, 6).flatten().tolist() == [0, 0, 0, 1, 1, 1]


def test_the_cpu_path_is_unchanged_sdpa_with_enable_gqa():
    # bitwise what causal_attention computed before the GPU guards were added
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 11, 4, 16), torch.randn(2, 11, 2, 16), torch.randn(2, 11, 2, 16)
    before = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            is_causal=True, enable_gqa=True).transpose(1, 2)
    assert torch.equal(causal_attention(q, k, v), before)


def test_flash_guards_name_what_rules_flash_out(monkeypatch):
    q = torch.randn(1, 4, 2, 8)
    monkeypatch.setattr(attention, "_flash_attn_func", None)
    assert flash_unavailable_reason(q) == "flash-attn is not installed (or does not import)"
    monkeypatch.setattr(attention, "_flash_attn_func", lambda *a, **k: None)
    assert flash_unavailable_reason(q) == "the tensors are not on a CUDA device"


def test_flash_limits_are_flash_attn_2s():
    assert attention.FLASH_MAX_HEAD_DIM == 256 and attention.FLASH_MIN_CAPABILITY == (8, 0)
    assert attention.FLASH_DETERMINISTIC_BACKWARD is True


# -- GPU --------------------------------------------------------------------------------

def _qkv(head_dim, kv_heads=8, dtype=torch.bfloat16, seq_len=256):
    torch.manual_seed(0)
    shape = (2, seq_len, 8, head_dim)
    q = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, seq_len, kv_heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, seq_len, kv_heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


def _gradients(q, k, v):
    for t in (q, k, v):
        t.grad = None
    out = causal_attention(q, k, v)
    out.backward(torch.ones_like(out) / math.sqrt(out.numel()))
    return [t.grad.clone() for t in (q, k, v)]


@pytest.mark.gpu
def test_flash_backward_is_bitwise_the_same_twice():
    pytest.importorskip("flash_attn")
    q, k, v = _qkv(128, kv_heads=2, seq_len=1024)
    assert flash_unavailable_reason(q) is None
    first, second = _gradients(q, k, v), _gradients(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
def test_a_head_dim_over_256_falls_back_to_sdpa_and_says_why():
    pytest.importorskip("flash_attn")
    q, k, v = _qkv(288)
    assert flash_unavailable_reason(q) == "head_dim 288 exceeds flash-attn's maximum of 256"
    attention._fallbacks_said.clear()
    with pytest.warns(UserWarning, match="head_dim 288 exceeds"):
        out = causal_attention(q, k, v)
    assert out.shape == q.shape


@pytest.mark.gpu
def test_fp32_gqa_on_cuda_matches_the_float64_reference():
    q, k, v = _qkv(64, kv_heads=2, dtype=torch.float32)
    reference = F.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2),
        is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(causal_attention(q, k, v).double(), reference, rtol=1e-4, atol=1e-4)
