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
partition of the model.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch
from pyarrow import fs as pafs

MANIFEST = "manifest.json"
FORMAT = "raypipe-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_BLOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def filesystem_for(uri: str | Path) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and path for a local path or a URI (s3://, gs://, file://)."""
    text = str(uri)
    if "://" not in text:
        # FileSystem.from_uri rejects relative paths; plain paths are local.
        return pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())
    filesystem, path = pafs.FileSystem.from_uri(text)
    return filesystem, path.rstrip("/")


def step_dir_name(step: int) -> str:
    """``step_00000120`` for step 120."""
    return f"step_{_check_step(step):08d}"


def layer_file_name(layer_index: int) -> str:
    """``layer_00003.pt`` for global layer 3."""
    if not isinstance(layer_index, int) or isinstance(layer_index, bool) or layer_index < 0:
        raise ValueError(f"layer_index must be a non-negative int, got {layer_index!r}")
    return f"layer_{layer_index:05d}.pt"


def write_layer(root_uri: str | Path, step: int, layer_index: int, state: Mapping[str, Any]) -> str:
    """Store one layer's state (``torch.save``) and return its file name within the step.

    Safe to call from many stage actors at once: each writes its own file.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"layer {layer_index} state must be a dict, got {type(state).__name__}")
    name = layer_file_name(layer_index)
    filesystem, step_dir = _open_step_for_writing(root_uri, step)
    _write_atomically(filesystem, f"{step_dir}/{name}", lambda stream: torch.save(dict(state), stream))
    return name


def write_blob(root_uri: str | Path, step: int, name: str, obj: Any) -> str:
    """Store an extra object (optimizer state, data position, ...) as ``<name>.pt``."""
    file_name = _blob_file_name(name)
    filesystem, step_dir = _open_step_for_writing(root_uri, step)
    _write_atomically(filesystem, f"{step_dir}/{file_name}", lambda stream: torch.save(obj, stream))
    return file_name


def write_manifest(
    root_uri: str | Path,
    step: int,
    layer_files: Mapping[int, str],
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Complete checkpoint ``step``: check that every layer file is stored, then write the manifest.

    ``layer_files`` maps every global layer index 0..n-1 to the name
    :func:`write_layer` returned; ``extra`` is any JSON-serializable metadata
    (config, data position, metrics). Blobs present in the step are recorded.
    Returns the manifest's path.
    """
    filesystem, step_dir = _open_step_for_writing(root_uri, step)
    layers = _check_layer_files(layer_files)
    stored = {info.base_name: info for info in _list_files(filesystem, step_dir)}
    for index, name in layers.items():
        if name not in stored:
            raise FileNotFoundError(
                f"cannot complete checkpoint {step_dir}: layer {index} file {name!r} is not stored there"
            )
    blobs = sorted(
        name for name in stored
        if name.endswith(".pt") and not name.startswith((".", "layer_"))
    )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "num_layers": len(layers),
        "layers": {str(index): name for index, name in layers.items()},
        "sizes": {name: stored[name].size for name in [*layers.values(), *blobs]},
        "blobs": [name[: -len(".pt")] for name in blobs],
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
        raise ValueError(f"checkpoint manifest {path} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a raypipe checkpoint manifest (format must be {FORMAT!r})")
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
    return _load(root_uri, step, name, map_location, weights_only=True)


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
    return _load(root_uri, step, _blob_file_name(name), map_location, weights_only)


def delete_checkpoint(root_uri: str | Path, step: int) -> None:
    """Remove checkpoint ``step``: manifest first, so it is never seen half-deleted."""
    filesystem, root = filesystem_for(root_uri)
    step_dir = f"{root}/{step_dir_name(step)}"
    manifest = f"{step_dir}/{MANIFEST}"
    if filesystem.get_file_info(manifest).type == pafs.FileType.File:
        filesystem.delete_file(manifest)
    if filesystem.get_file_info(step_dir).type == pafs.FileType.Directory:
        filesystem.delete_dir(step_dir)


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


def _check_layer_files(layer_files: Mapping[int, str]) -> dict[int, str]:
    layers = {}
    for index, name in layer_files.items():
        expected = layer_file_name(int(index))
        if name != expected:
            raise ValueError(f"layer {index} file must be {expected!r}, got {name!r}")
        layers[int(index)] = name
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


def _write_atomically(filesystem: pafs.FileSystem, path: str, write) -> None:
    """Write ``path`` so that readers never see a partial file.

    On a local disk: write a hidden temporary file, then rename it. Object
    stores (S3, GCS) publish an object only when its upload completes, and
    their "rename" is a copy, so they are written in place.
    """
    if not isinstance(filesystem, pafs.LocalFileSystem):
        with filesystem.open_output_stream(path) as stream:
            write(stream)
        return
    directory, _, name = path.rpartition("/")
    temporary = f"{directory}/.{name}.tmp-{uuid.uuid4().hex}"
    try:
        with filesystem.open_output_stream(temporary) as stream:
            write(stream)
        filesystem.move(temporary, path)
    except BaseException:
        if filesystem.get_file_info(temporary).type == pafs.FileType.File:
            filesystem.delete_file(temporary)
        raise


def _list_files(filesystem: pafs.FileSystem, directory: str) -> list[pafs.FileInfo]:
    return filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))


def _load(root_uri: str | Path, step: int, name: str, map_location: Any, weights_only: bool) -> Any:
    filesystem, root = filesystem_for(root_uri)
    path = f"{root}/{step_dir_name(step)}/{name}"
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(f"checkpoint file {path} is listed in its manifest but missing")
    try:
        with filesystem.open_input_file(path) as stream:
            return torch.load(stream, map_location=map_location, weights_only=weights_only)
    except Exception as error:
        raise ValueError(f"cannot read checkpoint file {path}: {error}") from error
