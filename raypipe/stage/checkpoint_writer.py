"""Checkpoint writes that do not stall training, inside one stage worker.

A save copies the worker's state to host memory at once, as a task in the
worker's step order (so the copy is the state after the last committed step:
the next step changes the weights in place): the copy is the bytes of its files
(:func:`~raypipe.checkpoint.store.encode`). Then a thread of its own hashes and
writes them while the worker goes on with its next step; both leave Python's GIL
to the step. The driver asks for the files with a task in the ``checkpoint``
concurrency group (a thread of its own, as heartbeats have), which waits for the
write and returns what it stored or raises its error.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from raypipe.checkpoint.store import StoredFile, step_dir_name
from raypipe.errors import CheckpointError
from raypipe.stage.host_copy import stage_to_host


@dataclass
class WrittenFiles:
    """What one worker stored for a checkpoint: its layer files (first replica) or
    optimizer-part blobs (ZeRO-1, other replicas), the bytes of its host copy (its
    files' bytes), and when its write started and finished (``time.time()``)."""

    layers: dict[int, StoredFile] = field(default_factory=dict)
    blobs: list[StoredFile] = field(default_factory=list)
    host_bytes: int = 0
    started_unix: float = 0.0
    finished_unix: float = 0.0


def on_host(state: Any) -> Any:
    """``state`` (nested dicts, lists and tuples) with its tensors on the host: the same
    tensors when they are there already, so that encoding one layer at a time holds
    at most one layer's device-to-host copies besides the bytes. A state with CUDA
    tensors is copied as snapshots are (:func:`~raypipe.stage.host_copy.stage_to_host`:
    pinned buffers, a side stream), and waited for."""
    device = _cuda_device_in(state)
    if device is not None:
        return stage_to_host(state, device).wait()
    return _held_on_host(state)


def _held_on_host(state: Any) -> Any:
    if torch.is_tensor(state):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {key: _held_on_host(value) for key, value in state.items()}
    if type(state) in (list, tuple):
        return type(state)(_held_on_host(value) for value in state)
    return state


def _cuda_device_in(state: Any) -> torch.device | None:
    """The device of the first CUDA tensor in ``state``, or None."""
    if torch.is_tensor(state):
        return state.device if state.device.type == "cuda" else None
    values = state.values() if isinstance(state, dict) else state if type(state) in (list, tuple) else ()
    return next((device for device in map(_cuda_device_in, values) if device is not None), None)


def write_named(root_uri: str, step: int, name: str, write: Callable[[], StoredFile]) -> StoredFile:
    """``write()`` one checkpoint file; any failure raises :class:`CheckpointError` naming it."""
    try:
        return write()
    except Exception as error:  # noqa: BLE001 - whatever the filesystem raises, named by the file
        path = f"{str(root_uri).rstrip('/')}/{step_dir_name(step)}/{name}"
        raise CheckpointError(path, f"could not be written: {type(error).__name__}: {error}") from error


class CheckpointWriter:
    """One thread that writes this worker's checkpoint copies, one save after another."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raypipe-checkpoint")
        self._writes: dict[int, Future] = {}
        self._lock = threading.Lock()  # start and finish run on different threads

    def start(self, step: int, host_bytes: int, write: Callable[[WrittenFiles], None]) -> None:
        """Run ``write(files)`` (which fills ``files``) on the writer thread."""
        def run() -> WrittenFiles:
            files = WrittenFiles(host_bytes=host_bytes, started_unix=time.time())
            write(files)
            files.finished_unix = time.time()
            return files

        with self._lock:
            self._writes[step] = self._thread.submit(run)

    def finish(self, step: int) -> WrittenFiles:
        """Wait for the write of ``step``: what it stored, or its error."""
        with self._lock:
            write = self._writes.pop(step, None)
        if write is None:
            raise RuntimeError(f"no checkpoint write of step {step} was started on this worker")
        return write.result()
