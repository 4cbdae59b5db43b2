"""Writing a raypipe LLaMA as a Hugging Face directory: ``config.json``,
``model-0000k-of-0000n.safetensors`` (one shard per pipeline layer) and
``model.safetensors.index.json``.

Shards are written where the weights are (each stage its own layers, in
parallel; or layer by layer from a checkpoint); the index and config, written
last from what the writers return, make the directory complete.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import torch
from pyarrow import fs as pafs

from raypipe.filesystem import filesystem_for
from raypipe.models.hf.config import hf_config_from_llama, llama_config_from_dict, llama_config_to_dict
from raypipe.models.hf.names import hf_names, shard_file_name
from raypipe.models.hf.weights import CONFIG, INDEX
from raypipe.models.llama import LlamaBlock, LlamaConfig, LlamaEmbedding, LlamaHead

DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}


def describe_llama(layers: Sequence[Any]) -> dict[str, Any] | None:
    """``{"llama_config": ..., "hf_config": ...}`` (JSON) when ``layers`` are a LLaMA's pipeline
    layers as :func:`llama_layers` or ``from_pretrained`` give them; None for any other model."""
    kinds = [getattr(layer, "cls", None) for layer in layers]
    if len(kinds) < 2 or kinds[0] is not LlamaEmbedding or kinds[-1] is not LlamaHead \
            or any(kind is not LlamaBlock for kind in kinds[1:-1]):
        return None
    config = layers[0].args[0]
    if not isinstance(config, LlamaConfig) or config.n_layers != len(layers) - 2:
        return None
    return {"llama_config": llama_config_to_dict(config), "hf_config": getattr(layers[0], "hf_config", None)}


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r}: must be one of {sorted(DTYPES)}")
    return dtype


def prepare_output(out_uri: str) -> None:
    """Create ``out_uri``; refuse one that already holds files (an export never mixes with another)."""
    filesystem, out = filesystem_for(out_uri)
    found = filesystem.get_file_info(pafs.FileSelector(out, allow_not_found=True))
    if found:
        raise FileExistsError(f"export directory {out_uri} is not empty: choose a new one")
    filesystem.create_dir(out, recursive=True)


def write_layer_shard(out_uri: str, layer_index: int, n_blocks: int, state: dict[str, torch.Tensor],
                      dtype: str) -> dict[str, Any]:
    """Write pipeline layer ``layer_index``'s tensors, renamed and cast, as its own shard;
    returns ``{"file", "tensors", "bytes"}`` for the index."""
    from safetensors.torch import save

    torch_dtype = DTYPES[check_dtype(dtype)][0]
    names = hf_names(layer_index, n_blocks)
    tensors = {names[key]: value.detach().to("cpu", torch_dtype).contiguous() for key, value in state.items()}
    file = shard_file_name(layer_index, n_blocks + 2)
    filesystem, out = filesystem_for(out_uri)
    with filesystem.open_output_stream(f"{out}/{file}") as stream:
        stream.write(save(tensors, metadata={"format": "pt"}))
    return {"file": file, "tensors": sorted(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def write_index_and_config(out_uri: str, model: dict[str, Any], dtype: str, shards: list[dict[str, Any]]) -> None:
    """Complete the export: the index of every tensor's shard, then ``config.json``."""
    config = llama_config_from_dict(model["llama_config"])
    expected = {shard_file_name(index, config.n_layers + 2) for index in range(config.n_layers + 2)}
    written = {shard["file"] for shard in shards}
    if written != expected:
        raise RuntimeError(f"export to {out_uri} is incomplete: missing shards {sorted(expected - written)}")
    index = {"metadata": {"total_size": sum(shard["bytes"] for shard in shards)},
             "weight_map": {name: shard["file"] for shard in shards for name in shard["tensors"]}}
    hf = hf_config_from_llama(config, DTYPES[dtype][1], model.get("hf_config"))
    filesystem, out = filesystem_for(out_uri)
    for name, content in ((INDEX, index), (CONFIG, hf)):
        with filesystem.open_output_stream(f"{out}/{name}") as stream:
            stream.write((json.dumps(content, indent=2, sort_keys=True) + "\n").encode())


def export_checkpoint(root_uri: str, step: int, out_uri: str, dtype: str = "bf16") -> str:
    """Convert raypipe checkpoint ``step`` under ``root_uri`` (of a LLaMA) into a Hugging Face
    directory at ``out_uri``, one layer in memory at a time; returns ``out_uri``."""
    from raypipe.checkpoint.parts import merged_model, read_layer_parts
    from raypipe.checkpoint.store import read_manifest

    check_dtype(dtype)
    extra = read_manifest(root_uri, step).get("extra", {})
    model = extra.get("model")
    if not model or "llama_config" not in model:
        raise ValueError(f"checkpoint step {step} under {root_uri} does not record a LLaMA model config "
                         "(it was not written by a trainer of llama_layers or from_pretrained)")
    n_blocks = model["llama_config"]["n_layers"]
    prepare_output(out_uri)
    parts = extra.get("optimizer_parts", 1)  # ZeRO-1 in bf16: each part holds its owner's main weights
    shards = [write_layer_shard(out_uri, index, n_blocks, merged_model(read_layer_parts(root_uri, step, index, parts)),
                                dtype) for index in range(n_blocks + 2)]
    write_index_and_config(out_uri, model, dtype, shards)
    return out_uri
