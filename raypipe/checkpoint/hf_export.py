"""A raypipe checkpoint of a LLaMA as a Hugging Face directory, without a trainer
(``raypipe export``): the checkpoint's layers read one at a time, written by
:mod:`raypipe.models.hf.export`. Here, not in ``models/``, because it reads
checkpoints, a layer above the models (docs/architecture.md, "Layer order")."""
from __future__ import annotations

from raypipe.checkpoint.parts import merged_model, read_layer_parts
from raypipe.checkpoint.store import read_manifest
from raypipe.models.hf.export import check_dtype, prepare_output, write_index_and_config, write_layer_shard


def export_checkpoint(root_uri: str, step: int, out_uri: str, dtype: str | None = None) -> str:
    """Convert raypipe checkpoint ``step`` under ``root_uri`` (of a LLaMA) into a Hugging Face
    directory at ``out_uri``, one layer in memory at a time; returns ``out_uri``.

    ``dtype``: None (default) writes the main weights as trained (fp32: twice the size of
    bf16, and the exported model computes what the trainer did); "bf16" or "fp16" casts
    them. ``config.json`` records the dtype written (see :mod:`raypipe.models.hf.export`).
    """
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
