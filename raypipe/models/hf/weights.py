"""Reading a Hugging Face LLaMA's tensors, one pipeline layer at a time.

The driver reads only ``config.json`` and the shard index (or, for a single
``model.safetensors``, its JSON header); each :class:`PretrainedLayer` is
built inside its stage actor and reads just its own tensors: memory-mapped
with ``safetensors.safe_open`` on a local disk, or the shard's bytes through
``pyarrow.fs`` for ``s3://`` / ``gs://``.
"""
from __future__ import annotations

import json
import struct
from collections import defaultdict
from typing import Any

import torch
from pyarrow import fs as pafs
from torch import nn

from raypipe.filesystem import filesystem_for
from raypipe.models.layers import LayerSpec

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG = "config.json"
# safetensors' dtype names (the format is little-endian, as torch.frombuffer reads on x86 and ARM)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def read_json(uri: str, name: str) -> dict[str, Any]:
    """``uri/name`` parsed; a FileNotFoundError naming it when absent."""
    filesystem, root = filesystem_for(uri)
    path = f"{root}/{name}"
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(f"{path} does not exist: not a Hugging Face model directory")
    with filesystem.open_input_stream(path) as stream:
        return json.loads(stream.read())


def weight_map(uri: str) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or the single file's header."""
    filesystem, root = filesystem_for(uri)
    if filesystem.get_file_info(f"{root}/{INDEX}").type == pafs.FileType.File:
        return dict(read_json(uri, INDEX)["weight_map"])
    path = f"{root}/{SINGLE_FILE}"
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(f"{uri} has neither {INDEX} nor {SINGLE_FILE} (only safetensors weights are read)")
    with filesystem.open_input_file(path) as file:
        header, _ = _read_header(file)
    return {name: SINGLE_FILE for name in header if name != "__metadata__"}


def read_tensor_ranges(filesystem: pafs.FileSystem, path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of the safetensors file ``path``, reading only the header and their bytes."""
    out = {}
    with filesystem.open_input_file(path) as file:
        header, data_start = _read_header(file)
        for name in names:
            if name not in header:
                raise KeyError(f"{path} has no tensor {name}")
            info = header[name]
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, not one raypipe reads")
            begin, end = info["data_offsets"]
            dtype = _DTYPES[info["dtype"]]
            if end == begin:
                out[name] = torch.empty(info["shape"], dtype=dtype)
                continue
            data = bytearray(file.read_at(end - begin, data_start + begin))
            out[name] = torch.frombuffer(data, dtype=dtype).reshape(info["shape"])
    return out


def _read_header(file: Any) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header (after its u64 length) and where the tensor data starts."""
    (length,) = struct.unpack("<Q", file.read_at(8, 0))
    return json.loads(file.read_at(length, 8)), 8 + length


def read_tensors(uri: str, tensors: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
    """``{key: (tensor name, shard file)}`` -> ``{key: tensor}``, one shard opened at a time."""
    by_shard: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key, (name, shard) in tensors.items():
        by_shard[shard].append((key, name))
    filesystem, root = filesystem_for(uri)
    out = {}
    for shard, wanted in by_shard.items():
        path = f"{root}/{shard}"
        if isinstance(filesystem, pafs.LocalFileSystem):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:  # memory-mapped: reads only these tensors
                out.update({key: handle.get_tensor(name) for key, name in wanted})
        else:
            loaded = read_tensor_ranges(filesystem, path, [name for _, name in wanted])
            out.update({key: loaded[name] for key, name in wanted})
    return out


class PretrainedLayer(LayerSpec):
    """A :class:`LayerSpec` whose layer, once built, loads its weights from a Hugging Face checkpoint.

    ``tensors`` maps the layer's state-dict keys to ``(tensor name, shard file)``
    under ``uri``. Built on the meta device (parameter counting) it reads nothing.
    ``hf_config`` is the checkpoint's ``config.json``, kept for export.
    """

    def __init__(self, cls: type[nn.Module], args: tuple, uri: str, tensors: dict[str, tuple[str, str]],
                 hf_config: dict[str, Any]) -> None:
        super().__init__(cls, *args)
        self.uri, self.tensors, self.hf_config = uri, tensors, hf_config

    def build(self, device: torch.device | str | None = None) -> nn.Module:
        module = super().build(device)
        if device is not None and torch.device(device).type == "meta":
            return module
        state = read_tensors(self.uri, self.tensors)
        shapes = {key: tuple(value.shape) for key, value in module.state_dict().items()}
        for key, tensor in state.items():
            expected = shapes[key]
            if tuple(tensor.shape) != expected:
                name, shard = self.tensors[key]
                raise ValueError(f"{self.uri}/{shard}: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"config.json implies {expected}")
        module.load_state_dict(state)  # strict: every parameter comes from the checkpoint
        return module

    def __repr__(self) -> str:
        return f"PretrainedLayer({self.cls.__name__}, {self.uri})"
