"""A checkpoint save in flight, finished on a driver thread.

The workers copy their state to host memory and write their files in the
background (:mod:`raypipe.stage.checkpoint_writer`). A driver thread waits for
every worker's files, then writes the manifest (which makes the checkpoint
complete: :func:`~raypipe.checkpoint.store.write_manifest` checks each file is
stored as written) and prunes to ``keep_last``. It completes the checkpoint as
soon as its files are written, not at the driver's next call, so a driver lost
later loses as little as possible.

A worker that dies, hangs or becomes unreachable while it writes leaves the
checkpoint incomplete (no manifest, which loading ignores) with a warning; the
trainer heals the worker at its next step and training goes on. A write error
(permissions, a full disk, a file where a directory should be) is kept and
raised, naming the file, to whoever waits for the save next.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ray

from raypipe.checkpoint.store import prune_checkpoints, write_manifest
from raypipe.errors import CheckpointError, RaypipeError
from raypipe.runtime.health import Watchdog

logger = logging.getLogger("raypipe")


@dataclass(frozen=True)
class SavedCheckpoint:
    """A finished save: ``complete`` when every file and the manifest are stored
    (False: a worker was lost while writing, and no manifest was written).
    ``host_bytes`` is what the workers' host copies held while the save was in
    flight, ``seconds`` the time from the save's start to its manifest, and
    ``written_unix`` when each writing worker finished (``time.time()``, in the
    order of ``writers``: the first replica's stages, then ZeRO-1's other replicas)."""

    step: int
    root_uri: str
    complete: bool
    host_bytes: int
    seconds: float
    writers: tuple[str, ...]
    written_unix: tuple[float | None, ...]


@dataclass(frozen=True)
class SaveRequest:
    """What a save writes: ``writers`` are the actors that write files (the first
    replica's, which write the layer files, then those writing optimizer parts),
    named by ``names``; ``manifest_extra`` goes into the manifest."""

    root_uri: str
    step: int
    writers: list
    names: list[str]
    manifest_extra: Mapping[str, Any]
    keep_last: int | None
    hang_timeout_s: float


class PendingSave:
    """One save in flight: submitted at construction, finished on its own thread."""

    def __init__(self, request: SaveRequest) -> None:
        self.request = request
        self._started = time.monotonic()
        step = request.step
        copies = [actor.start_checkpoint.remote(request.root_uri, step) for actor in request.writers]
        self._written = [actor.checkpoint_files.remote(step, copy) for actor, copy in zip(request.writers, copies)]
        self._done: Future = Future()
        threading.Thread(target=self._run, name=f"raypipe-checkpoint-{step}", daemon=True).start()

    def result(self) -> SavedCheckpoint:
        """Wait for the save: what it wrote, or its write error."""
        return self._done.result()

    def _run(self) -> None:
        try:
            self._done.set_result(self._finish())
        except BaseException as error:  # noqa: BLE001 - kept for whoever waits on the save
            self._done.set_exception(error)

    def _finish(self) -> SavedCheckpoint:
        request = self.request
        lost = Watchdog(request.hang_timeout_s).wait(self._written, request.writers)
        finished = set(ray.wait(self._written, num_returns=len(self._written), timeout=0, fetch_local=False)[0])
        written: list = [None] * len(self._written)
        for index, ref in enumerate(self._written):
            if index not in lost and ref in finished:  # unfinished only when another writer was lost
                try:
                    written[index] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    lost[index] = "died"
                except ray.exceptions.RayTaskError as error:
                    raise _write_error(error, request.step, request.names[index]) from None
        if not lost:
            self._complete(written)
        else:
            named = ", ".join(f"{request.names[index]} {why}" for index, why in sorted(lost.items()))
            logger.warning("raypipe: checkpoint step %d under %s is not complete (%s while writing it): no manifest "
                           "was written, and training goes on", request.step, request.root_uri, named)
        return SavedCheckpoint(
            step=request.step, root_uri=request.root_uri, complete=not lost,
            host_bytes=sum(files.host_bytes for files in written if files is not None),
            seconds=time.monotonic() - self._started, writers=tuple(request.names),
            written_unix=tuple(None if files is None else files.finished_unix for files in written))

    def _complete(self, written: list) -> None:
        """Every file is written: the manifest, then retention."""
        request = self.request
        layer_files = {index: file for files in written for index, file in files.layers.items()}
        blobs = [blob for files in written for blob in files.blobs]
        write_manifest(request.root_uri, request.step, layer_files, extra=request.manifest_extra, blobs=blobs)
        if request.keep_last is not None:
            prune_checkpoints(request.root_uri, request.keep_last)


def _write_error(error: ray.exceptions.RayTaskError, step: int, writer: str) -> RaypipeError:
    """A worker's failed save as the error a user acts on: a CheckpointError naming the file."""
    cause = error.cause
    if isinstance(cause, CheckpointError):
        return CheckpointError(cause.path, f"{cause.problem} (checkpoint step {step}, {writer})")
    return RaypipeError(f"checkpoint step {step}: {writer} failed to save: {cause!r}")
