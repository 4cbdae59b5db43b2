"""Sharded, per-layer checkpoints on any pyarrow filesystem (local, S3, GCS).

Layout under a root URI::

    ROOT/step_00000120/layer_00000.pt   one file per GLOBAL layer index
    ROOT/step_00000120/layer_00001.pt
    ROOT/step_00000120/<name>.pt        optional blobs (optimizer, data position, ...)
    ROOT/step_00000120/manifest.json    written LAST

Stage actors write their layers in parallel; the driver writes the manifest
once every layer is stored. A checkpoint exists only when its manifest does,
so a crash mid-save leaves an incomplete step that :func:`latest_checkpoint`
ignores. Keys are global layer indices, so a checkpoint loads into any
partition of the model. The manifest records each file's size and SHA-256,
hashed as it is written and verified as it is read: a damaged or missing file
raises :class:`~raypipe.errors.CheckpointError` naming it.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

import torch
from pyarrow import fs as pafs

from raypipe.errors import CheckpointError
from raypipe.filesystem import filesystem_for

MANIFEST = "manifest.json"
FORMAT = "raypipe-checkpoint"
VERSION = 2  # 2: per-file SHA-256; version 1 manifests (sizes only) still load
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_BLOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class StoredFile(NamedTuple):
    """A file written into a checkpoint step: its name there, size and SHA-256 (hex)."""

    name: str
    size: int
    sha256: str


def step_dir_name(step: int) -> str:
    """``step_00000120`` for step 120."""
    return f"step_{_check_step(step):08d}"


def layer_file_name(layer_index: int) -> str:
    """``layer_00003.pt`` for global layer 3."""
    if not isinstance(layer_index, int) or isinstance(layer_index, bool) or layer_index < 0:
        raise ValueError(f"layer_index must be a non-negative int, got {layer_index!r}")
    return f"layer_{layer_index:05d}.pt"


def write_layer(root_uri: str | Path, step: int, layer_index: int, state: Mapping[str, Any]) -> StoredFile:
    """Store one layer's state (``torch.save``); returns the file written, with its checksum.

    Safe to call from many stage actors at once: each writes its own file.
    """
    return write_encoded_layer(root_uri, step, layer_index, encode_layer(layer_index, state))


def write_blob(root_uri: str | Path, step: int, name: str, obj: Any) -> StoredFile:
    """Store an extra object (optimizer state, data position, ...) as ``<name>.pt``;
    pass what it returns to :func:`write_manifest`'s ``blobs``."""
    return write_encoded_blob(root_uri, step, name, encode(obj))


def encode(obj: Any) -> bytes:
    """``obj`` as the bytes of its checkpoint file (``torch.save``): a copy of its
    tensors in host memory, which later changes to them do not reach."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def encode_layer(layer_index: int, state: Mapping[str, Any]) -> bytes:
    """One layer's state as the bytes of its checkpoint file (see :func:`encode`)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"layer {layer_index} state must be a dict, got {type(state).__name__}")
    return encode(dict(state))


def write_encoded_layer(root_uri: str | Path, step: int, layer_index: int, payload: bytes) -> StoredFile:
    """:func:`write_layer` of a state already :func:`encode_layer`-d (hashing and writing
    bytes leave Python's GIL to a step running meanwhile)."""
    filesystem, step_dir = _open_step_for_writing(root_uri, step)
    return _write_atomically(filesystem, f"{step_dir}/{layer_file_name(layer_index)}",
                             lambda stream: stream.write(payload))


def write_encoded_blob(root_uri: str | Path, step: int, name: str, payload: bytes) -> StoredFile:
    """:func:`write_blob` of an object already :func:`encode`-d."""
    file_name = _blob_file_name(name)
    filesystem, step_dir = _open_step_for_writing(root_uri, step)
    return _write_atomically(filesystem, f"{step_dir}/{file_name}", lambda stream: stream.write(payload))


def write_manifest(
    root_uri: str | Path,
    step: int,
    layer_files: Mapping[int, StoredFile],
    extra: Mapping[str, Any] | None = None,
    blobs: Iterable[StoredFile] = (),
) -> str:
    """Complete checkpoint ``step``: check that every file is stored, then write the manifest.

    ``layer_files`` maps every global layer index 0..n-1 to what
    :func:`write_layer` returned, ``blobs`` are what :func:`write_blob`
    returned; ``extra`` is any JSON-serializable metadata (config, data
    position, metrics). Returns the manifest's path.
    """
    filesystem, step_dir = _open_step_for_writing(root_uri, step)
    layers = _check_layer_files(layer_files)
    blobs = sorted(blobs, key=lambda blob: blob.name)
    stored = {info.base_name: info for info in _list_files(filesystem, step_dir)}
    for what, file in [*((f"layer {index} file", file) for index, file in layers.items()),
                       *(("blob", blob) for blob in blobs)]:
        _check_stored(step_dir, what, file, stored.get(file.name))
    files = [*layers.values(), *blobs]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "num_layers": len(layers),
        "layers": {str(index): file.name for index, file in layers.items()},
        "sizes": {file.name: file.size for file in files},
        "sha256": {file.name: file.sha256 for file in files},
        "blobs": [blob.name[: -len(".pt")] for blob in blobs],
        "created_unix": time.time(),
        "extra": dict(extra or {}),
    }
    try:
        payload = json.dumps(manifest, indent=2, sort_keys=True).encode()
    except TypeError as error:
        raise TypeError(f"checkpoint extra metadata for {step_dir} is not JSON-serializable: {error}") from None
    path = f"{step_dir}/{MANIFEST}"
    _write_atomically(filesystem, path, lambda stream: stream.write(payload))
    return path


def list_checkpoints(root_uri: str | Path) -> list[int]:
    """Steps of all complete checkpoints (those with a manifest), oldest first."""
    filesystem, root = filesystem_for(root_uri)
    steps = {}
    for info in _list_files(filesystem, root):
        match = _STEP_DIR.match(info.base_name)
        if match and info.type == pafs.FileType.Directory:
            steps[int(match.group(1))] = f"{info.path}/{MANIFEST}"
    if not steps:
        return []
    manifests = filesystem.get_file_info(list(steps.values()))
    return sorted(step for step, info in zip(steps, manifests) if info.type == pafs.FileType.File)


def latest_checkpoint(root_uri: str | Path) -> int | None:
    """The newest complete checkpoint's step, or None; incomplete steps are ignored."""
    steps = list_checkpoints(root_uri)
    return steps[-1] if steps else None


def read_manifest(root_uri: str | Path, step: int) -> dict[str, Any]:
    """The manifest of checkpoint ``step``; a clear error when it is missing or incomplete."""
    filesystem, root = filesystem_for(root_uri)
    path = f"{root}/{step_dir_name(step)}/{MANIFEST}"
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(
            f"no complete checkpoint at step {step}: {path} does not exist "
            f"(complete steps under {root}: {list_checkpoints(root_uri)})"
        )
    with filesystem.open_input_stream(path) as stream:
        raw = stream.read()
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"is not valid JSON (a damaged manifest): {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(path, f"is not a raypipe checkpoint manifest (format must be {FORMAT!r})")
    return manifest


def read_layer(
    root_uri: str | Path, step: int, layer_index: int, map_location: Any = "cpu"
) -> dict[str, Any]:
    """The state stored for global layer ``layer_index`` in checkpoint ``step``."""
    manifest = read_manifest(root_uri, step)
    name = manifest["layers"].get(str(layer_index))
    if name is None:
        raise KeyError(
            f"checkpoint step {step} under {root_uri} has no layer {layer_index}; "
            f"it holds layers 0..{manifest['num_layers'] - 1}"
        )
    return _load(root_uri, step, manifest, name, map_location, weights_only=True)


def read_blob(
    root_uri: str | Path, step: int, name: str, map_location: Any = "cpu", weights_only: bool = True
) -> Any:
    """An object stored with :func:`write_blob` in checkpoint ``step``.

    ``weights_only=False`` allows arbitrary pickled objects; only use it on
    checkpoints you trust.
    """
    manifest = read_manifest(root_uri, step)
    if name not in manifest["blobs"]:
        raise KeyError(
            f"checkpoint step {step} under {root_uri} has no blob {name!r}; "
            f"it holds {manifest['blobs']}"
        )
    return _load(root_uri, step, manifest, _blob_file_name(name), map_location, weights_only)


def delete_checkpoint(root_uri: str | Path, step: int) -> None:
    """Remove checkpoint ``step``: manifest first, so it is never seen half-deleted."""
    filesystem, root = filesystem_for(root_uri)
    step_dir = f"{root}/{step_dir_name(step)}"
    manifest = f"{step_dir}/{MANIFEST}"
    if filesystem.get_file_info(manifest).type == pafs.FileType.File:
        filesystem.delete_file(manifest)
    if filesystem.get_file_info(step_dir).type == pafs.FileType.Directory:
        filesystem.delete_dir(step_dir)


def prune_checkpoints(root_uri: str | Path, keep_last: int) -> list[int]:
    """Delete all but the newest ``keep_last`` (>= 1) complete checkpoints; returns the steps deleted."""
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    old = list_checkpoints(root_uri)[:-keep_last]
    for step in old:
        delete_checkpoint(root_uri, step)
    return old


# --- helpers -----------------------------------------------------------------


def _check_step(step: int) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    return step


def _blob_file_name(name: str) -> str:
    if not isinstance(name, str) or not _BLOB_NAME.match(name) or name.startswith("layer_") \
            or name == MANIFEST.removesuffix(".json"):
        raise ValueError(
            f"invalid checkpoint blob name {name!r}: use letters, digits, '_', '.', '-', "
            "not starting with 'layer_' and not 'manifest'"
        )
    return f"{name}.pt"


def _check_layer_files(layer_files: Mapping[int, StoredFile]) -> dict[int, StoredFile]:
    layers = {}
    for index, file in layer_files.items():
        expected = layer_file_name(int(index))
        if not isinstance(file, StoredFile) or file.name != expected:
            raise ValueError(f"layer {index} file must be the StoredFile of {expected!r} that write_layer "
                             f"returned, got {file!r}")
        layers[int(index)] = file
    missing = sorted(set(range(len(layers))) - set(layers))
    if not layers or missing:
        raise ValueError(
            f"a checkpoint needs every global layer 0..n-1; got layers {sorted(layers)}"
            + (f", missing {missing}" if missing else "")
        )
    return dict(sorted(layers.items()))


def _open_step_for_writing(root_uri: str | Path, step: int) -> tuple[pafs.FileSystem, str]:
    filesystem, root = filesystem_for(root_uri)
    step_dir = f"{root}/{step_dir_name(step)}"
    if filesystem.get_file_info(f"{step_dir}/{MANIFEST}").type == pafs.FileType.File:
        # Overwriting files under an existing manifest would leave a
        # "complete" checkpoint with mixed contents if this save crashed.
        raise FileExistsError(
            f"checkpoint {step_dir} is already complete; delete_checkpoint() it before saving step {step} again"
        )
    filesystem.create_dir(step_dir, recursive=True)
    return filesystem, step_dir


class _HashingWriter:
    """A write-only stream that hashes and counts what passes through it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._stream.write(data)

    def flush(self) -> None:
        self._stream.flush()


def _write_atomically(filesystem: pafs.FileSystem, path: str, write) -> StoredFile:
    """Write ``path`` so that readers never see a partial file; return it with its checksum.

    On a local disk: write a hidden temporary file, then rename it. Object
    stores (S3, GCS) publish an object only when its upload completes, and
    their "rename" is a copy, so they are written in place.
    """
    directory, _, name = path.rpartition("/")
    local = isinstance(filesystem, pafs.LocalFileSystem)
    target = f"{directory}/.{name}.tmp-{uuid.uuid4().hex}" if local else path
    try:
        with filesystem.open_output_stream(target) as stream:
            hashing = _HashingWriter(stream)
            write(hashing)
        if local:
            filesystem.move(target, path)
    except BaseException:
        if local and filesystem.get_file_info(target).type == pafs.FileType.File:
            filesystem.delete_file(target)
        raise
    return StoredFile(name, hashing.size, hashing.sha256.hexdigest())


def _check_stored(step_dir: str, what: str, file: StoredFile, info: pafs.FileInfo | None) -> None:
    """``file`` is in the step as it was written (same size)."""
    if info is None:
        raise FileNotFoundError(f"cannot complete checkpoint {step_dir}: {what} {file.name!r} is not stored there")
    if info.size != file.size:
        raise FileNotFoundError(f"cannot complete checkpoint {step_dir}: {what} {file.name!r} is not stored there "
                                f"as written ({info.size} bytes, {file.size} written)")


def _list_files(filesystem: pafs.FileSystem, directory: str) -> list[pafs.FileInfo]:
    return filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))


def _load(root_uri: str | Path, step: int, manifest: Mapping[str, Any], name: str, map_location: Any,
          weights_only: bool) -> Any:
    filesystem, root = filesystem_for(root_uri)
    path = f"{root}/{step_dir_name(step)}/{name}"
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        raise CheckpointError(path, "is listed in its manifest but missing")
    with filesystem.open_input_stream(path) as stream:
        data = stream.read()
    _verify(path, data, manifest.get("sizes", {}).get(name), manifest.get("sha256", {}).get(name))
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except Exception as error:
        raise CheckpointError(path, f"cannot be read: {error}") from error


def _verify(path: str, data: bytes, size: int | None, sha256: str | None) -> None:
    """The file is what the manifest recorded (version 1 manifests record sizes only)."""
    if size is not None and len(data) != size:
        raise CheckpointError(path, f"is damaged: {len(data)} bytes where the manifest recorded {size}")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(path, "is damaged: its SHA-256 differs from the one in the manifest")
