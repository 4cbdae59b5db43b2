"""Which Hugging Face tensor each raypipe LLaMA parameter is.

raypipe's pipeline layer ``i`` of a model with ``n`` blocks is the embedding
(``i == 0``), block ``i - 1``, or the head (``i == n + 1``). The tensors need no
reordering: raypipe's attention views q/k as (heads, head_dim) in the order the
projections produce them and rotates dimension ``j`` with ``j + head_dim/2``,
exactly as transformers' ``rotate_half`` does.
"""
from __future__ import annotations

_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def hf_names(layer_index: int, n_blocks: int) -> dict[str, str]:
    """raypipe state-dict key -> Hugging Face tensor name, for pipeline layer ``layer_index``."""
    if not 0 <= layer_index <= n_blocks + 1:
        raise ValueError(f"layer {layer_index} is outside a LLaMA of {n_blocks} blocks (layers 0..{n_blocks + 1})")
    if layer_index == 0:
        return {"tokens.weight": EMBEDDING}
    if layer_index == n_blocks + 1:
        return {"norm.weight": "model.norm.weight", "output.weight": HEAD}
    prefix = f"model.layers.{layer_index - 1}."
    return {key: prefix + name for key, name in _BLOCK.items()}


def all_hf_names(n_blocks: int) -> list[str]:
    """Every tensor name of an untied LLaMA of ``n_blocks`` blocks."""
    return [name for index in range(n_blocks + 2) for name in hf_names(index, n_blocks).values()]


def shard_file_name(layer_index: int, num_layers: int) -> str:
    """``model-0000k-of-0000n.safetensors``: one shard per pipeline layer, numbered from 1."""
    return f"model-{layer_index + 1:05d}-of-{num_layers:05d}.safetensors"
