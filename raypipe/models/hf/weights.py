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
import sys
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


Region = tuple[slice, ...]  # the part of a tensor to read, one slice per leading dimension (the rest whole)


def read_tensor_ranges(filesystem: pafs.FileSystem, path: str, names: list[str],
                       regions: dict[str, Region | None] | None = None,
                       shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of the safetensors file ``path`` (each name's ``regions`` entry: only that
    part), reading only the header and their bytes: a part that is a range of the first dimension's
    rows (a row-split tensor-parallel shard) reads just those rows; another part (a column split)
    reads the tensor and keeps the part. A tensor whose whole shape is not its ``shapes`` entry is
    named before anything is read."""
    out = {}
    regions, shapes = regions or {}, shapes or {}
    with filesystem.open_input_file(path) as file:
        header, data_start = _read_header(file)
        for name in names:
            if name not in header:
                raise KeyError(f"{path} has no tensor {name}")
            info = header[name]
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, not one raypipe reads")
            check_shape(path, name, tuple(info["shape"]), shapes.get(name))
        for name in names:
            info = header[name]
            begin, end = info["data_offsets"]
            dtype, shape, region = _DTYPES[info["dtype"]], tuple(info["shape"]), regions.get(name)
            rows = _row_range(region, shape)
            if rows is not None and end > begin:  # only the rows' bytes
                row_bytes = (end - begin) // shape[0]
                first, last = rows
                data = bytearray(file.read_at((last - first) * row_bytes, data_start + begin + first * row_bytes))
                out[name] = torch.frombuffer(data, dtype=dtype).reshape((last - first, *shape[1:]))
                continue
            whole = (torch.empty(shape, dtype=dtype) if end == begin
                     else torch.frombuffer(bytearray(file.read_at(end - begin, data_start + begin)),
                                           dtype=dtype).reshape(shape))
            out[name] = whole if region is None else whole[region].contiguous()
    return out


def check_shape(path: str, name: str, shape: tuple[int, ...], expected: tuple[int, ...] | None) -> None:
    """A ValueError naming the file and tensor when ``shape`` is not the ``expected`` one (None: any)."""
    if expected is not None and shape != expected:
        raise ValueError(f"{path}: tensor {name} has shape {shape}, config.json implies {expected}")


def _row_range(region: Region | None, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(first, last) row when ``region`` is a range of the first dimension only, else None."""
    if region is None or not shape or any(part != slice(None) for part in region[1:]):
        return None
    first, last, step = region[0].indices(shape[0])
    return (first, last) if step == 1 else None


def _read_header(file: Any) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header (after its u64 length) and where the tensor data starts."""
    (length,) = struct.unpack("<Q", file.read_at(8, 0))
    return json.loads(file.read_at(length, 8)), 8 + length


def read_tensors(uri: str, tensors: dict[str, tuple[str, str]], regions: dict[str, Region | None] | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """``{key: (tensor name, shard file)}`` -> ``{key: tensor}``, one shard opened at a time.
    ``regions``: per key, only that part of the tensor is read (safetensors' ``get_slice`` on a
    local disk; on object storage the rows' byte range, or the whole tensor for a column part);
    ``shapes``: per key, the whole shape it must have (checked before any tensor is read)."""
    by_shard: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key, (name, shard) in tensors.items():
        by_shard[shard].append((key, name))
    regions, shapes = regions or {}, shapes or {}
    filesystem, root = filesystem_for(uri)
    out = {}
    for shard, wanted in by_shard.items():
        path = f"{root}/{shard}"
        if isinstance(filesystem, pafs.LocalFileSystem):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:  # memory-mapped: reads only these tensors (parts)
                parts = {key: handle.get_slice(name) for key, name in wanted}
                for key, name in wanted:
                    check_shape(f"{uri}/{shard}", name, tuple(parts[key].get_shape()), shapes.get(key))
                for key, name in wanted:
                    region = regions.get(key)
                    out[key] = handle.get_tensor(name) if region is None else parts[key][region].contiguous()
        else:
            loaded = read_tensor_ranges(filesystem, path, [name for _, name in wanted],
                                        {name: regions.get(key) for key, name in wanted},
                                        {name: shapes.get(key) for key, name in wanted})
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
        """Constructed and its weights read (on "meta": nothing read)."""
        module = self.construct(device)
        if device is None or torch.device(device).type != "meta":
            self.load_weights(module)
        return module

    def load_weights(self, module: nn.Module) -> None:
        """Read the layer's tensors into ``module``: every state-dict entry comes from the checkpoint,
        a parameter split over a tensor-parallel mesh reading only this rank's part of its rows or
        columns. A tensor whose shape is not what config.json implies is named before any is read."""
        live = module.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(live) - set(self.tensors)), sorted(set(self.tensors) - set(live))
        if missing or unexpected:
            raise ValueError(f"{self.uri}: the layer's tensors {missing} are not mapped to the checkpoint"
                             if missing else f"{self.uri}: the checkpoint's tensors {unexpected} are not the layer's")
        regions = {key: _local_region(tensor) for key, tensor in live.items()}
        state = read_tensors(self.uri, self.tensors, regions, {key: tuple(tensor.shape) for key, tensor in live.items()})
        with torch.no_grad():
            for key, tensor in state.items():
                (live[key] if regions[key] is None else live[key].to_local()).copy_(tensor)

    def __repr__(self) -> str:
        return f"PretrainedLayer({self.cls.__name__}, {self.uri})"


def _local_region(tensor: torch.Tensor) -> Region | None:
    """The part of a tensor split over a tensor-parallel mesh that this rank holds; None for a whole one."""
    dtensors = sys.modules.get("torch.distributed.tensor")  # not imported: nothing is split (seconds of import)
    if dtensors is None or not isinstance(tensor, dtensors.DTensor):
        return None
    from raypipe.models.tensor_parallel import local_region

    return local_region(tensor)
