"""A Hugging Face LLaMA ``config.json`` to :class:`LlamaConfig` and back.

Fields that change the computation in ways raypipe's LLaMA does not implement
are refused by name rather than silently ignored: a model that loads but
computes something else is worse than one that does not load.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from raypipe.errors import ConfigError
from raypipe.models.llama import LlamaConfig
from raypipe.models.rotary import LLAMA3_ROPE_KEYS

_ARCHITECTURE = "LlamaForCausalLM"


def llama_config_from_hf(hf: dict[str, Any], max_seq_len: int | None = None,
                         untie_embeddings: bool = False) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face LLaMA ``config.json`` (as a dict).

    ``max_seq_len``: the longest sequence the model will see, sizing the rotary tables;
    None: the checkpoint's ``max_position_embeddings``.
    ``tie_word_embeddings: true`` is refused unless ``untie_embeddings``.
    """
    check_supported(hf, untie_embeddings)
    if max_seq_len is None:
        max_seq_len = hf.get("max_position_embeddings")
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
            _refuse("max_position_embeddings", max_seq_len,
                    "must be an int >= 1 to size the rotary tables (or pass max_seq_len)")
    elif not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
        raise ConfigError("max_seq_len", max_seq_len, "must be None or an int >= 1 (the longest sequence)")
    rope = _rope_parameters(hf)
    return LlamaConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads"),
        ffn_dim=hf["intermediate_size"], max_seq_len=max_seq_len, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_llama3_scaling(rope, hf))


def check_supported(hf: dict[str, Any], untie_embeddings: bool = False) -> None:
    """Raise a ConfigError naming the first field of ``hf`` that raypipe's LLaMA cannot reproduce."""
    if hf.get("model_type") != "llama":
        _refuse("model_type", hf.get("model_type"), "only 'llama' checkpoints are supported")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if name not in hf:
            _refuse(name, None, "is missing")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "only 'silu' (SwiGLU) is supported")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            _refuse(name, hf[name], "biases are not supported (raypipe's LLaMA linears have none)")
    if hf.get("attention_dropout", 0.0):
        _refuse("attention_dropout", hf["attention_dropout"], "dropout on attention probabilities is not supported")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        _refuse("head_dim", head_dim, f"must be hidden_size / num_attention_heads = "
                                      f"{hf['hidden_size'] // hf['num_attention_heads']}")
    if hf.get("quantization_config"):
        _refuse("quantization_config", "...", "quantized checkpoints are not supported")
    rope = _rope_parameters(hf)
    if _rope_type(rope) not in ("default", "llama3"):
        _refuse("rope_scaling", _rope_type(rope), "only rope_type 'llama3' (or no scaling) is supported")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse("partial_rotary_factor", rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")),
                "must be 1.0 (every dimension rotates)")
    if hf.get("tie_word_embeddings", False) and not untie_embeddings:
        _refuse("tie_word_embeddings", True, "tied input/output embeddings are not kept tied across stages; "
                                             "pass untie_embeddings=True to start the head as a copy of the "
                                             "embedding and train them separately")


def hf_config_from_llama(config: LlamaConfig, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``config``: ``base`` (the imported checkpoint's, if any) with every field
    that describes the weights overwritten; embeddings are written untied."""
    hf = {key: value for key, value in (base or {}).items() if key != "rope_parameters"}
    hf.update({
        "architectures": [_ARCHITECTURE], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.dim, "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        # the weights' dtype: transformers 5 reads "dtype" (and, if absent, "torch_dtype"),
        # transformers 4 and other readers "torch_dtype"
        "tie_word_embeddings": False, "dtype": dtype, "torch_dtype": dtype,
        "max_position_embeddings": max(config.max_seq_len, (base or {}).get("max_position_embeddings", 0)),
    })
    scaling = None if config.rope_scaling is None else {"rope_type": "llama3", **config.rope_scaling}
    hf["rope_scaling"] = scaling  # transformers 4 reads this, 5 converts it into rope_parameters
    return hf


def llama_config_to_dict(config: LlamaConfig) -> dict[str, Any]:
    """JSON-serializable fields (for a checkpoint manifest); :func:`llama_config_from_dict` inverts it."""
    return dataclasses.asdict(config)


def llama_config_from_dict(values: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(**values)


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes ``rope_parameters``, 4 writes ``rope_scaling`` (None without scaling)."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _llama3_scaling(rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, float] | None:
    if _rope_type(rope) != "llama3":
        return None
    values = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **rope}
    missing = [key for key in LLAMA3_ROPE_KEYS if values.get(key) is None]
    if missing:
        _refuse("rope_scaling", rope, f"llama3 scaling needs {', '.join(missing)}")
    return {key: float(values[key]) for key in LLAMA3_ROPE_KEYS}


def _refuse(field: str, value: Any, reason: str) -> None:
    raise ConfigError(f"config.json {field}", value, reason)
