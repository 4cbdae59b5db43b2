"""The LLaMA-style model: shapes, rotary embeddings, causal attention, init, loss, counts."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from raypipe.models.attention import causal_attention
from raypipe.models.layers import LayerSpec
from raypipe.models.llama import (CONFIGS, LlamaBlock, LlamaConfig, LlamaEmbedding, LlamaHead, get_config,
                                  llama_layers, llama_loss, num_parameters)
from raypipe.models.rotary import apply_rotary, rotary_tables


def tiny(**changes) -> LlamaConfig:
    return get_config("tiny").replace(**changes)


def build(config: LlamaConfig, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(spec.build() for spec in llama_layers(config)))


# -- configs and parameter counts ---------------------------------------------------

def test_named_configs():
    assert get_config("tiny").vocab_size == 259  # 256 bytes + <bos>, <eos>, <pad>
    seven = get_config("llama-7b")
    assert (seven.n_layers, seven.dim, seven.n_heads, seven.ffn_dim, seven.vocab_size) == (32, 4096, 32, 11008, 32000)
    assert get_config("tiny") is not CONFIGS["tiny"]  # a copy: callers may modify it


def test_replacing_heads_keeps_multi_head_attention():
    config = get_config("tiny").replace(n_heads=8)
    assert config.n_kv_heads is None and config.num_kv_heads == 8


def test_unknown_config_lists_known_names():
    with pytest.raises(ValueError, match="llama-7b") as error:
        get_config("gpt-5")
    assert "gpt-5" in str(error.value) and "tiny" in str(error.value)


@pytest.mark.parametrize("changes, field", [
    ({"dim": 130}, "dim"),             # not divisible by 4 heads
    ({"n_kv_heads": 3}, "n_kv_heads"),  # does not divide 4 heads
    ({"n_layers": 0}, "n_layers"),
    ({"dropout": 1.0}, "dropout"),
])
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        tiny(**changes)


def test_llama_7b_has_6_74_billion_parameters():
    config = get_config("llama-7b")
    analytic = num_parameters(config)
    meta = sum(spec.num_parameters() for spec in llama_layers(config))  # built on the meta device
    assert analytic == meta == 6_738_415_616  # LLaMA-2 7B's published count
    assert abs(analytic - 6.74e9) / 6.74e9 < 0.001


@pytest.mark.parametrize("name", ["tiny", "llama-1b"])
def test_analytic_count_matches_built_layers(name):
    config = get_config(name)
    assert num_parameters(config) == sum(spec.num_parameters() for spec in llama_layers(config))
    if name == "llama-1b":
        assert 1.0e9 < num_parameters(config) < 1.2e9


def test_tiny_parameter_count_of_real_modules():
    model = build(get_config("tiny"))
    assert sum(p.numel() for p in model.parameters()) == num_parameters(get_config("tiny"))


def test_layers_are_specs_embedding_blocks_head():
    layers = llama_layers("tiny")
    assert all(isinstance(layer, LayerSpec) for layer in layers)
    assert [layer.cls for layer in layers] == [LlamaEmbedding] + [LlamaBlock] * 4 + [LlamaHead]


# -- forward ---------------------------------------------------------------------------

def test_shapes_through_the_layers():
    config = tiny()
    model = build(config)
    ids = torch.randint(0, config.vocab_size, (3, 17))
    hidden = model[0](ids)
    assert hidden.shape == (3, 17, config.dim)
    for block in model[1:-1]:
        hidden = block(hidden)
        assert hidden.shape == (3, 17, config.dim)
    assert model[-1](hidden).shape == (3, 17, config.vocab_size)


def test_any_length_up_to_max_seq_len_and_a_clear_error_beyond():
    config = tiny(max_seq_len=32)
    model = build(config)
    for length in (1, 5, 32):  # micro-batches of different lengths in one step
        assert model(torch.randint(0, 259, (2, length))).shape == (2, length, 259)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model(torch.randint(0, 259, (2, 33)))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model[1](torch.randn(2, 33, config.dim))  # a block alone on a later stage checks too


def test_bad_token_ids_are_a_clear_error():
    embedding = LlamaEmbedding(tiny())
    with pytest.raises(ValueError, match=r"token id 259 is outside the vocabulary \[0, 259\)"):
        embedding(torch.tensor([[1, 259]]))
    with pytest.raises(ValueError, match="dtype"):
        embedding(torch.zeros(1, 4))


def test_causal_prefix_does_not_see_the_future():
    model = build(tiny())
    ids = torch.randint(0, 259, (2, 24))
    changed = ids.clone()
    changed[:, 12:] = torch.randint(0, 259, (2, 12))
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_init_is_deterministic_from_torch_rng():
    first, again, other = build(tiny(), seed=1), build(tiny(), seed=1), build(tiny(), seed=2)
    for a, b, c in zip(first.state_dict().values(), again.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert not torch.equal(first[1].attention.wq.weight, other[1].attention.wq.weight)
    # residual projections are scaled down with depth (GPT-2 init)
    block = first[1]
    assert block.attention.wo.weight.std() < 0.7 * block.attention.wq.weight.std()


def test_rotary_tables_are_not_in_the_state_dict():
    block = LlamaBlock(tiny(), 0)
    assert not any("rope" in key for key in block.state_dict())
    assert block.attention.rope_cos.shape == (256, 16)


def test_rotary_tables_first_built_under_inference_mode_still_train():
    """The shared tables outlive the forward that built them: built in an inference_mode
    forward (an evaluation first), they must still serve a training forward and backward."""
    from raypipe.models.rotary import clear_shared_rotary_tables

    clear_shared_rotary_tables()
    model = torch.nn.Sequential(*(spec.build() for spec in llama_layers(tiny(n_layers=2, max_seq_len=32))))
    tokens = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        evaluated = model(tokens)
    logits = model(tokens)
    llama_loss(logits, tokens).backward()
    assert torch.equal(evaluated, logits.detach()) and model[1].attention.wq.weight.grad is not None
    assert not model[1].attention.rope_cos.is_inference()


def test_dropout_only_when_configured_and_only_in_training():
    assert isinstance(LlamaBlock(tiny(), 0).dropout, torch.nn.Identity)
    torch.manual_seed(0)
    block = LlamaBlock(tiny(dropout=0.5), 0)
    x = torch.randn(2, 8, 128)
    torch.manual_seed(1)
    first = block(x)
    torch.manual_seed(2)
    assert not torch.allclose(first, block(x))
    torch.manual_seed(1)
    assert torch.equal(first, block(x))  # masks come from torch's RNG: replayable
    block.eval()
    assert torch.equal(block(x), block(x))


# -- rotary and attention against naive references -------------------------------------

def naive_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Pair dimension j with j + d/2 as a complex number and multiply by e^{i t theta^(-2j/d)}."""
    _batch, seq_len, _heads, dim = x.shape
    half = dim // 2
    out = torch.empty_like(x, dtype=torch.float64)
    for t in range(seq_len):
        for j in range(half):
            angle = t * theta ** (-2.0 * j / dim)
            z = torch.complex(x[:, t, :, j].double(), x[:, t, :, j + half].double()) * complex(math.cos(angle), math.sin(angle))
            out[:, t, :, j], out[:, t, :, j + half] = z.real, z.imag
    return out


def test_rotary_matches_complex_multiplication():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 8)
    cos, sin = rotary_tables(8, 16, theta=10000.0)
    rotated = apply_rotary(x, cos[:9], sin[:9])
    torch.testing.assert_close(rotated.double(), naive_rotary(x, 10000.0), rtol=1e-5, atol=1e-5)
    # a rotation: norms per pair are kept, and position 0 is unchanged
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, 0], x[:, 0])


def test_rotary_makes_scores_depend_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    cos, sin = rotary_tables(16, 64, theta=10000.0)

    def score(i: int, j: int) -> torch.Tensor:
        return (apply_rotary(q, cos[i:i + 1], sin[i:i + 1]) * apply_rotary(k, cos[j:j + 1], sin[j:j + 1])).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37))
    assert not torch.allclose(score(5, 2), score(5, 4))


def naive_causal_attention(q, k, v):
    """softmax(QK^T / sqrt(d) + mask) V on (B, T, H, d), K/V heads repeated for GQA."""
    q, k, v = (t.transpose(1, 2).double() for t in (q, k, v))
    repeat = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    seq_len = q.size(2)
    mask = torch.full((seq_len, seq_len), float("-inf"), dtype=torch.float64).triu(1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + mask
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_path_matches_naive_causal_attention(kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 11, 4, 16)
    k, v = torch.randn(2, 11, kv_heads, 16), torch.randn(2, 11, kv_heads, 16)
    torch.testing.assert_close(causal_attention(q, k, v).double(), naive_causal_attention(q, k, v),
                               rtol=1e-5, atol=1e-5)


def test_gqa_block_runs_and_counts_fewer_parameters():
    config = tiny(n_kv_heads=2)
    block = LlamaBlock(config, 0)
    assert block(torch.randn(2, 6, 128)).shape == (2, 6, 128)
    assert block.attention.wk.weight.shape == (64, 128)
    assert sum(p.numel() for p in block.parameters()) < sum(p.numel() for p in LlamaBlock(tiny(), 0).parameters())


# -- loss and a little training ---------------------------------------------------------

def test_loss_is_mean_over_non_ignored_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 259)
    targets = torch.randint(0, 259, (2, 5))
    targets[0, :3] = -100
    log_probs = logits.log_softmax(-1)
    kept = [(b, t) for b in range(2) for t in range(5) if targets[b, t] != -100]
    expected = -sum(log_probs[b, t, targets[b, t]] for b, t in kept) / len(kept)
    torch.testing.assert_close(llama_loss(logits, targets), expected)


def test_tiny_model_learns_a_repeated_sequence():
    torch.manual_seed(0)
    model = build(tiny())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.arange(33).repeat(4, 1) % 7
    inputs, targets = ids[:, :-1], ids[:, 1:]
    losses = []
    for _ in range(30):
        loss = llama_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > math.log(259) - 0.5  # starts near uniform
    assert losses[-1] < 0.5  # and learns the period-7 pattern


# -- GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_flash_attn_path_matches_sdpa(dtype, kv_heads):
    pytest.importorskip("flash_attn")
    from raypipe.models import attention

    assert attention._flash_attn_func is not None
    torch.manual_seed(0)
    q = torch.randn(2, 300, 8, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 300, kv_heads, 64, device="cuda", dtype=dtype)
    v = torch.randn(2, 300, kv_heads, 64, device="cuda", dtype=dtype)
    flash = causal_attention(q, k, v)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=kv_heads != 8).transpose(1, 2)
    torch.testing.assert_close(flash.float(), sdpa.float(), rtol=2e-2, atol=2e-2)
    reference = naive_causal_attention(q.float(), k.float(), v.float()).float()
    torch.testing.assert_close(flash.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_block_on_cuda_bf16_uses_flash_and_trains():
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    block = LlamaBlock(tiny(), 0).cuda().to(torch.bfloat16)
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = block(x)
    out.float().square().mean().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


def test_partition_gives_first_and_last_stages_fewer_blocks_for_their_embedding_and_head():
    from raypipe.models.layers import layer_parameter_count
    from raypipe.core.partition import partition_by_cost

    specs = llama_layers("llama-1b")  # embedding and head are ~1.5 blocks of parameters each
    balance = partition_by_cost([layer_parameter_count(spec) for spec in specs], 4)
    blocks = [balance[0] - 1, *balance[1:-1], balance[-1] - 1]
    assert blocks[0] < min(blocks[1:-1]) and blocks[-1] < min(blocks[1:-1]), balance
    assert sum(blocks) == 22
