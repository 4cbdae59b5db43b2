"""The shape of a LLaMA-style model (:class:`LlamaConfig`), its named presets
(:data:`CONFIGS`, :func:`get_config`) and its parameter count: what the layers
(:mod:`raypipe.models.llama`), their costs (:mod:`raypipe.models.llama_costs`) and their
memory (:mod:`raypipe.models.llama_memory`) are built from. :mod:`raypipe.models.llama`
re-exports all four, the names users import."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raypipe.models.rotary import LLAMA3_ROPE_KEYS


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
