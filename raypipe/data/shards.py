"""The on-disk format of a prepared dataset: manifest, Parquet shards, their checks."""
from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from raypipe.filesystem import filesystem_for

MANIFEST = "manifest.json"
FORMAT = "raypipe-tokens"
VERSION = 1
COLUMN = "tokens"
SPLITS = ("train", "validation")
DEFAULT_ROWS_PER_SHARD = 4096
STDLIB_CORPUS = "python-stdlib"


def placement_phase(seed: int) -> float:
    """Where the validation rows fall, drawn from ``prepare``'s seed."""
    return random.Random(seed).random()


def is_validation_row(row: int, val_fraction: float, phase: float) -> bool:
    """Whether the corpus's row ``row`` (counted over both splits) is a validation row: where
    ``floor(row * f + phase)`` steps up, so exactly a fraction ``f`` of rows, spread evenly."""
    return math.floor((row + 1) * val_fraction + phase) > math.floor(row * val_fraction + phase)


def validation_rows(num_rows: int, val_fraction: float, seed: int) -> np.ndarray:
    """:func:`is_validation_row` of the corpus's first ``num_rows`` rows (the same float64 arithmetic)."""
    rows, phase = np.arange(num_rows, dtype=np.float64), placement_phase(seed)
    return np.floor((rows + 1) * val_fraction + phase) > np.floor(rows * val_fraction + phase)


# --- reading -----------------------------------------------------------------


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the dataset at ``path`` (local path or URI), checked for the fields readers need."""
    filesystem, root = filesystem_for(path)
    manifest_path = f"{root}/{MANIFEST}"
    if filesystem.get_file_info(manifest_path).type != pafs.FileType.File:
        raise FileNotFoundError(f"no dataset at {path}: {manifest_path} does not exist (run `raypipe prepare`)")
    with filesystem.open_input_stream(manifest_path) as stream:
        raw = stream.read()
    try:
        manifest = json.loads(raw)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got {manifest.get('format')!r}")
        for key in ("vocab_size", "seq_len", "splits", "tokenizer"):
            if key not in manifest:
                raise ValueError(f"missing field {key!r}")
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                if not {"file", "num_rows", "sha256"} <= shard.keys():
                    raise ValueError(f"shard entry {shard} of split {split!r} needs file, num_rows and sha256")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"dataset manifest {manifest_path} is invalid: {error}") from None
    return manifest


def read_file(filesystem: pafs.FileSystem, path: str) -> pa.Buffer:
    """The bytes of one shard: memory-mapped when local, read whole from a remote filesystem."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        return pa.memory_map(path).read_buffer()  # pages in lazily, zero-copy
    with filesystem.open_input_file(path) as stream:
        return stream.read_buffer()


def verify_shard(path: str, data: pa.Buffer, shard: dict[str, Any], row_length: int) -> None:
    """Checksum, row count and schema of one shard, against its manifest entry."""
    digest = hashlib.sha256(memoryview(data)).hexdigest()
    if digest != shard["sha256"]:
        raise ValueError(
            f"checksum mismatch for shard {path}: sha256 {digest}, manifest says {shard['sha256']} "
            "(the file changed after `raypipe prepare`; prepare the dataset again)"
        )
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
    except pa.ArrowException as error:
        raise ValueError(f"shard {path} is not a readable Parquet file: {error}") from None
    schema = parquet.schema_arrow
    _check_schema(path, schema, row_length)
    if parquet.metadata.num_rows != shard["num_rows"]:
        raise ValueError(
            f"shard {path} holds {parquet.metadata.num_rows} rows, manifest says {shard['num_rows']}"
        )


def _check_schema(path: str, schema: pa.Schema, row_length: int) -> None:
    expected = f"a column {COLUMN!r} of list<int> (or fixed_size_list<int>[{row_length}])"
    if COLUMN not in schema.names:
        raise ValueError(f"shard {path} has the wrong schema: columns {schema.names}, expected {expected}")
    kind = schema.field(COLUMN).type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not is_list or not pa.types.is_integer(kind.value_type):
        raise ValueError(f"shard {path} has the wrong schema: column {COLUMN!r} is {kind}, expected {expected}")
    if pa.types.is_fixed_size_list(kind) and kind.list_size != row_length:
        raise ValueError(
            f"shard {path} has the wrong schema: rows of {kind.list_size} tokens, "
            f"expected seq_len+1 = {row_length}"
        )


def decode_rows(path: str, data: pa.Buffer, row_length: int, vocab_size: int) -> np.ndarray:
    """The (rows, row_length) int32 token array of a verified shard; bad rows are named."""
    column = pq.read_table(pa.BufferReader(data), columns=[COLUMN]).column(COLUMN).combine_chunks()
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"shard {path} row {row} is null")
    if not pa.types.is_fixed_size_list(column.type):
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        wrong = np.flatnonzero(lengths != row_length)
        if wrong.size:
            row = int(wrong[0])
            raise ValueError(f"shard {path} row {row} has {lengths[row]} tokens, expected seq_len+1 = {row_length}")
    values = column.flatten()
    if values.null_count:
        position = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"shard {path} row {position // row_length} has a null token")
    tokens = values.to_numpy(zero_copy_only=False).reshape(-1, row_length)
    check_vocabulary(path, tokens, vocab_size)
    return tokens.astype(np.int32, copy=False)


def check_vocabulary(path: str, tokens: np.ndarray, vocab_size: int) -> None:
    """Every token id of ``tokens`` (a shard's rows) in ``[0, vocab_size)``; else the first bad row is named."""
    if tokens.size == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size):
        return
    bad = np.flatnonzero(((tokens < 0) | (tokens >= vocab_size)).any(axis=1))
    row = int(bad[0])
    token = int(tokens[row][(tokens[row] < 0) | (tokens[row] >= vocab_size)][0])
    raise ValueError(f"shard {path} row {row} holds token id {token}, outside the vocabulary [0, {vocab_size})")


def verify_split_files(root: str | Path, manifest: dict[str, Any], split: str, vocab_size: int | None = None,
                       check: Callable[[str, pa.Buffer, np.ndarray], None] | None = None) -> int:
    """:func:`verify_shard` for every shard of ``split`` (and, given ``vocab_size``, every
    token id through :func:`decode_rows`, then ``check(path, data, tokens)``): reads every
    byte of the split; returns how many."""
    filesystem, base = filesystem_for(root)
    row_length = manifest["seq_len"] + 1
    size = 0
    for shard in manifest["splits"][split]["shards"]:
        path = f"{base}/{shard['file']}"
        data = read_file(filesystem, path)
        verify_shard(path, data, shard, row_length)
        if vocab_size is not None:
            tokens = decode_rows(path, data, row_length, vocab_size)
            if check is not None:
                check(path, data, tokens)
        size += data.size
    return size


def check_split_files(root: str | Path, manifest: dict[str, Any], split: str) -> None:
    """Every shard of ``split`` exists, with the size the manifest records (manifests from
    before sizes were recorded: exists). One listing per directory of shards and no shard
    read: the checksum, schema and rows are checked where a shard is first decoded."""
    filesystem, base = filesystem_for(root)
    shards = manifest["splits"][split]["shards"]
    found: dict[str, pafs.FileInfo] = {}
    for directory in sorted({f"{base}/{shard['file']}".rsplit("/", 1)[0] for shard in shards}):
        try:
            listing = filesystem.get_file_info(pafs.FileSelector(directory))
        except FileNotFoundError:
            listing = []
        found.update((info.path, info) for info in listing if info.type == pafs.FileType.File)
    for shard in shards:
        path = f"{base}/{shard['file']}"
        info = found.get(path)
        if info is None:
            raise ValueError(f"shard {path} of the {split} split is missing (the manifest lists it); "
                             "prepare the dataset again, or restore the file")
        if "num_bytes" in shard and info.size != shard["num_bytes"]:
            raise ValueError(f"shard {path} has {info.size} bytes, the manifest says {shard['num_bytes']} "
                             "(the file changed after `raypipe prepare`; prepare the dataset again)")
