"""Writing a raypipe LLaMA as a Hugging Face directory: ``config.json``,
``model-0000k-of-0000n.safetensors`` (one shard per pipeline layer) and
``model.safetensors.index.json``.

Shards are written where the weights are (each stage its own layers, in
parallel; or layer by layer from a checkpoint, :mod:`raypipe.checkpoint.hf_export`);
the index and config, written last from what the writers return, make the
directory complete.

The dtype: by default (``dtype=None``) the weights as they are trained, i.e. the
fp32 main weights of every precision setting, so the export computes exactly what
the trainer did; "bf16" or "fp16" when asked, half the files' size (an fp32 export
is twice a bf16 one: 4 bytes per parameter, ~27 GB for a 7B model), rounding each
weight, so an fp32-trained model's loss moves (the tests' tiny LLaMA: 1.9e-4 relative
from the rounding, 3.4e-4 as transformers loads it, in bf16). ``config.json`` records
the dtype written (``dtype`` and ``torch_dtype``), which transformers' default
``dtype="auto"`` loads the weights in.
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


def check_dtype(dtype: str | None) -> str | None:
    """``dtype`` if an export can write it: a name of :data:`DTYPES`, or None (as trained)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r}: must be one of {sorted(DTYPES)} or None (as trained)")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.float32 -> "float32", as config.json spells it


def prepare_output(out_uri: str) -> None:
    """Create ``out_uri``; refuse one that already holds files (an export never mixes with another)."""
    filesystem, out = filesystem_for(out_uri)
    found = filesystem.get_file_info(pafs.FileSelector(out, allow_not_found=True))
    if found:
        raise FileExistsError(f"export directory {out_uri} is not empty: choose a new one")
    filesystem.create_dir(out, recursive=True)


def write_layer_shard(out_uri: str, layer_index: int, n_blocks: int, state: dict[str, torch.Tensor],
                      dtype: str | None = None) -> dict[str, Any]:
    """Write pipeline layer ``layer_index``'s tensors, renamed, as its own shard: cast to
    ``dtype``, or as they are (None); returns ``{"file", "tensors", "bytes", "dtype"}``
    for the index and config ("dtype": the floating-point tensors' dtype as written)."""
    from safetensors.torch import save

    check_dtype(dtype)
    names = hf_names(layer_index, n_blocks)
    if dtype is None:
        tensors = {names[key]: value.detach().to("cpu").contiguous() for key, value in state.items()}
    else:
        tensors = {names[key]: value.detach().to("cpu", DTYPES[dtype][0]).contiguous()
                   for key, value in state.items()}
    written = {_dtype_name(tensor.dtype) for tensor in tensors.values() if tensor.is_floating_point()}
    if len(written) > 1:
        raise ValueError(f"pipeline layer {layer_index} holds weights of several dtypes {sorted(written)}: "
                         "export it with one dtype (dtype='fp32', 'bf16' or 'fp16')")
    file = shard_file_name(layer_index, n_blocks + 2)
    filesystem, out = filesystem_for(out_uri)
    with filesystem.open_output_stream(f"{out}/{file}") as stream:
        stream.write(save(tensors, metadata={"format": "pt"}))
    return {"file": file, "tensors": sorted(tensors), "dtype": next(iter(written), None),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def write_index_and_config(out_uri: str, model: dict[str, Any], dtype: str | None,
                           shards: list[dict[str, Any]]) -> str:
    """Complete the export: the index of every tensor's shard, then ``config.json``
    recording the weights' dtype (``dtype``'s, or with None the one the shards were
    written in); returns that dtype's name ("float32", "bfloat16", "float16")."""
    config = llama_config_from_dict(model["llama_config"])
    expected = {shard_file_name(index, config.n_layers + 2) for index in range(config.n_layers + 2)}
    written = {shard["file"] for shard in shards}
    if written != expected:
        raise RuntimeError(f"export to {out_uri} is incomplete: missing shards {sorted(expected - written)}")
    index = {"metadata": {"total_size": sum(shard["bytes"] for shard in shards)},
             "weight_map": {name: shard["file"] for shard in shards for name in shard["tensors"]}}
    written_dtypes = {shard.get("dtype") for shard in shards} - {None}
    if dtype is None and len(written_dtypes) != 1:
        raise ValueError(f"export to {out_uri}: the layers were trained in different dtypes "
                         f"{sorted(written_dtypes)}; export with one dtype ('fp32', 'bf16' or 'fp16')")
    dtype_name = DTYPES[dtype][1] if dtype is not None else written_dtypes.pop()
    hf = hf_config_from_llama(config, dtype_name, model.get("hf_config"))
    filesystem, out = filesystem_for(out_uri)
    for name, content in ((INDEX, index), (CONFIG, hf)):
        with filesystem.open_output_stream(f"{out}/{name}") as stream:
            stream.write((json.dumps(content, indent=2, sort_keys=True) + "\n").encode())
    return dtype_name
