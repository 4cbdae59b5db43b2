"""A LLaMA-style decoder as a list of pipeline layers.

One readable file, in the spirit of nanoGPT: token embedding, ``n_layers``
blocks (RMSNorm, causal self-attention with rotary position embeddings,
SwiGLU MLP, residuals), final RMSNorm and LM head. Every layer takes one
tensor and returns one tensor, so any contiguous run of them is a pipeline
stage: ``llama_layers(config)`` gives the list as :class:`~raypipe.LayerSpec`.

Attention runs flash-attn's ``flash_attn_func`` when it imports, the tensors
are CUDA bf16/fp16, head_dim is at most 256 and the card is Ampere or newer,
otherwise ``torch.nn.functional.scaled_dot_product_attention`` (a CUDA run that
could have used flash-attn says once why it did not). Rotary embeddings use the
"rotate half" pairing (dimension ``j`` with ``j + head_dim/2``), as Hugging Face
checkpoints do; their cos/sin tables are built once per process (per stage) and
shared by every block (:func:`shared_rotary_tables`), not stored in each block.

Determinism (raypipe promises a healed run is bitwise the uninterrupted one): the
forward is deterministic on every path; flash-attn's backward runs its deterministic
variant; on CPU SDPA is deterministic. SDPA's CUDA backward kernels (flash,
memory-efficient) sum with atomics unless ``torch.use_deterministic_algorithms(True)``
is on when the backward runs (it also needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8``), so
on GPU without flash-attn the bitwise promise holds only under that setting.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raypipe.models.layers import LayerSpec

try:  # optional: the [gpu] extra
    from flash_attn import flash_attn_func as _flash_attn_func
except (ImportError, OSError):  # not installed, or built against another CUDA/torch
    _flash_attn_func = None

IGNORE_INDEX = -100  # targets with this value count neither in the loss nor in its mean
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class LlamaConfig:
    """Shape of a LLaMA-style model. ``n_kv_heads`` < ``n_heads`` is grouped-query attention."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_seq_len: int
    n_kv_heads: int | None = None  # None: as many as n_heads (multi-head attention)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0  # on the attention and MLP outputs, before each residual add
    # Llama 3.1's rotary frequency scaling: factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings (Hugging Face's rope_type "llama3"); None: plain rotary
    rope_scaling: dict[str, float] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name}={value!r}: must be an int >= 1")
        kv_heads = self.n_kv_heads
        if kv_heads is not None and (not isinstance(kv_heads, int) or kv_heads < 1 or self.n_heads % kv_heads):
            raise ValueError(f"LlamaConfig.n_kv_heads={kv_heads!r}: must be None or an int >= 1 "
                             f"dividing n_heads={self.n_heads}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig.dim={self.dim}: must be n_heads ({self.n_heads}) times an "
                             "even head dimension (rotary embeddings rotate pairs of dimensions)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LlamaConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig: norm_eps={self.norm_eps!r} and rope_theta={self.rope_theta!r} must be > 0")
        if self.rope_scaling is not None:
            missing = sorted(set(LLAMA3_ROPE_KEYS) - set(self.rope_scaling))
            if missing:
                raise ValueError(f"LlamaConfig.rope_scaling lacks {missing}: llama3 scaling needs {LLAMA3_ROPE_KEYS}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads (``n_kv_heads``, or ``n_heads`` when it is None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: object) -> LlamaConfig:
        """A copy with some fields changed (e.g. ``dropout=0.1``)."""
        return dataclasses.replace(self, **changes)


CONFIGS: dict[str, LlamaConfig] = {
    # byte tokenizer: 256 bytes + <bos>, <eos>, <pad>; ~0.8M parameters, trains on CPU in minutes
    "tiny": LlamaConfig(vocab_size=259, dim=128, n_layers=4, n_heads=4, ffn_dim=352, max_seq_len=256),
    # TinyLlama-1.1B's shape (grouped-query attention, 4 KV heads)
    "llama-1b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                            ffn_dim=5632, max_seq_len=2048),
    # LLaMA-2 7B's shape: ~6.74e9 parameters
    "llama-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008,
                            max_seq_len=4096),
    # Llama 3 / 3.1's shapes (8.0e9, 70.6e9, 405.9e9 parameters; pre-training sequence length 8192, so no
    # rope_scaling: Llama 3.1 adds it for its 128k context), for `raypipe plan --cluster ...`
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                               ffn_dim=53248, max_seq_len=8192, rope_theta=500000.0),
}


def get_config(name: str) -> LlamaConfig:
    """The named config (a copy, safe to modify)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(CONFIGS))}")
    return dataclasses.replace(CONFIGS[name])


def num_parameters(config: LlamaConfig) -> int:
    """Parameter count, computed from the shapes (no weights built)."""
    d, kv = config.dim, config.kv_dim
    block = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * config.ffn_dim  # 2 norms, wq wo, wk wv, w1 w2 w3
    return config.vocab_size * d + config.n_layers * block + d + d * config.vocab_size


# -- building blocks ---------------------------------------------------------------

def _init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)


def rotary_tables(head_dim: int, max_seq_len: int, theta: float,
                  scaling: dict[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, shape (max_seq_len, head_dim // 2), fp32.

    Position ``t`` rotates the pair (j, j + head_dim/2) by ``t * theta**(-2j/head_dim)``,
    the frequencies rescaled as Llama 3.1 does when ``scaling`` is given.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


_shared_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_shared_tables_lock = threading.Lock()


def shared_rotary_tables(head_dim: int, max_positions: int, theta: float, scaling: dict[str, float] | None,
                         device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_tables` on ``device``, built once per process and shared by every caller.

    Every block of a stage asks for the same tables, so a stage holds one pair whatever its
    number of blocks (a checkpoint's ``max_position_embeddings`` can be 131072: 32 MiB per
    table at head_dim 128). Computed on the CPU in fp32 and then copied, as a module's
    buffers were, so the values are bitwise those of a per-block table. Not module buffers:
    they stay out of state dicts and checkpoints, and ``module.to()`` cannot split them.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    scaling_key = None if scaling is None else tuple(sorted((k, float(v)) for k, v in scaling.items()))
    key = (head_dim, max_positions, float(theta), scaling_key, torch.float32, device)
    tables = _shared_tables.get(key)
    if tables is None:
        with _shared_tables_lock:  # stage threads may run blocks concurrently: still one build
            tables = _shared_tables.get(key)
            if tables is None:
                # CPU math whatever the caller's default device, as the buffers had; normal tensors
                # even when the first caller runs under inference_mode (training reuses them)
                with torch.device("cpu"), torch.inference_mode(False), torch.no_grad():
                    cos, sin = rotary_tables(head_dim, max_positions, theta, scaling)
                    tables = _shared_tables[key] = (cos.to(device), sin.to(device))
    return tables


def clear_shared_rotary_tables() -> None:
    """Forget the shared tables (their memory is freed once no tensor refers to them)."""
    with _shared_tables_lock:
        _shared_tables.clear()


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths longer than the original context / low_freq_factor
    are stretched by ``factor``, shorter than context / high_freq_factor kept, those between blended."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(wavelength > context / low, inv_freq / factor,
                       torch.where(wavelength < context / high, inv_freq, scaled))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, heads, head_dim) by the angles of its positions; cos/sin are (T, head_dim/2)."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds the model's max_seq_len={self.max_seq_len}")
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        cos, sin = self.rotary(q.device)
        # copies of the first seq_len rows, so what autograd saves is seq_len rows in every
        # precision, never a view pinning the whole shared table (the memory model counts so)
        cos, sin = cos[:seq_len].to(q.dtype, copy=True), sin[:seq_len].to(q.dtype, copy=True)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = causal_attention(q, k, v)
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
    """Token ids (B, T) -> hidden states (B, T, dim)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = config.vocab_size, config.max_seq_len
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        nn.init.normal_(self.tokens.weight, mean=0.0, std=0.02)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if token_ids.dtype not in (torch.int64, torch.int32) or token_ids.dim() != 2:
            raise ValueError(f"LlamaEmbedding expects token ids of shape (batch, seq_len) and dtype "
                             f"int64/int32, got shape {tuple(token_ids.shape)} and {token_ids.dtype}")
        if token_ids.size(1) > self.max_seq_len:
            raise ValueError(f"sequence length {token_ids.size(1)} exceeds the model's max_seq_len={self.max_seq_len}")
        if token_ids.numel():
            low, high = int(token_ids.min()), int(token_ids.max())
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class LlamaHead(nn.Module):
    """Hidden states (B, T, dim) -> logits (B, T, vocab_size)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        _init_linear(self.output, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


def llama_layers(config: LlamaConfig | str, *, seq_len: int | None = None, precision: str = "fp32",
                 fused_attention: bool = True) -> list[LayerSpec]:
    """The model as pipeline layers: embedding, ``n_layers`` blocks, head.

    Each spec carries its :class:`~raypipe.models.layers.LayerCost` for one sequence of
    ``seq_len`` tokens (default: ``max_seq_len``) in ``precision``
    (:mod:`raypipe.models.llama_costs`), which ``PipelineConfig(balance="time")`` uses.
    """
    from raypipe.models.llama_costs import llama_layer_costs  # it builds on this module

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
