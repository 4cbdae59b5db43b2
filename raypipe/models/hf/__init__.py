"""Hugging Face LLaMA checkpoints: import as pipeline layers, export back.

``from_pretrained(path)`` gives the layers of a safetensors
LLaMA (local directory, ``s3://`` or ``gs://``), each loading its own weights
inside its stage actor. :func:`~raypipe.checkpoint.hf_export.export_checkpoint`
and ``PipelineTrainer.export_hf`` write a directory ``transformers`` loads.

Tied embeddings (``tie_word_embeddings: true``, e.g. Llama 3.2 1B/3B) are not
kept tied across the first and last stage: they are refused unless
``untie_embeddings=True``, which starts the head as a copy of the embedding;
the two then train separately and export writes ``tie_word_embeddings: false``.
"""
from __future__ import annotations

from pathlib import Path

from raypipe.models.hf.config import llama_config_from_hf
from raypipe.models.hf.names import EMBEDDING, HEAD, hf_names
from raypipe.models.hf.weights import CONFIG, PretrainedLayer, read_json, weight_map
from raypipe.models.llama import llama_layers


def from_pretrained(uri: str | Path, max_seq_len: int | None = None,
                    untie_embeddings: bool = False) -> list[PretrainedLayer]:
    """A Hugging Face LLaMA directory as pipeline layers (embedding, blocks, head), weights loaded in the stages.

    ``max_seq_len``: the longest sequence the model will see (longer ones are refused);
    None: the checkpoint's ``max_position_embeddings``. It sizes the rotary tables, which
    each stage builds once, on first use, and shares among its blocks (at 131072 positions
    and head_dim 128, 64 MiB of fp32 cos and sin per stage); a smaller ``max_seq_len``
    makes them smaller. The layers' costs (``PipelineConfig(balance="time")``) are for
    ``max_seq_len``-token sequences; :func:`raypipe.models.llama_costs.with_llama_costs`
    re-costs them for the run's. Unsupported ``config.json`` fields raise a ConfigError
    naming them; ``tie_word_embeddings: true`` too, unless ``untie_embeddings`` (the head
    then starts as a copy of the embedding).
    """
    uri = str(uri)
    hf = read_json(uri, CONFIG)
    config = llama_config_from_hf(hf, max_seq_len, untie_embeddings)
    available = weight_map(uri)
    layers = []
    for index, spec in enumerate(llama_layers(config)):
        names = hf_names(index, config.n_layers)
        if hf.get("tie_word_embeddings", False) and names.get("output.weight") == HEAD:
            names["output.weight"] = EMBEDDING  # transformers ignores a stored lm_head when tied
        missing = [name for name in names.values() if name not in available]
        if missing:
            raise ValueError(f"{uri}: the checkpoint has no tensor {missing[0]} (pipeline layer {index}); "
                             "is it a LlamaForCausalLM?")
        tensors = {key: (name, available[name]) for key, name in names.items()}
        layers.append(PretrainedLayer(spec.cls, spec.args, uri, tensors, hf).with_tp_plan(spec.tp_plan))
    return layers


__all__ = ["from_pretrained", "PretrainedLayer"]
