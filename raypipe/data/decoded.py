"""Decoded shards on the reader's local disk, memory-mapped.

A step's rows come from a permutation of the whole split, so within a few
steps a reader touches every shard. Holding each decoded shard in process
memory would grow a reader to the size of the split (for a corpus of 100B
tokens, 400 GB per reading stage). Instead a shard is decoded once per node
into a ``.npy`` file named by its sha256 (so any dataset holding the same
bytes shares it, and the processes on a node share one copy) and read back
memory-mapped: the kernel's page cache holds what is hot and drops the rest.
This is Megatron's layout (a memory-mapped token file), built lazily from the
Parquet shards.

The copies stay for the next run on the node, unless ``$RAYPIPE_DECODED_LIMIT``
caps them: each new copy then removes the least recently opened others until the
node's copies fit. A reader that has a removed copy open keeps reading it (the
mapping holds the file), and a later opener decodes it again. Partial copies
that writers killed mid-write left are swept once per process.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from raypipe.data.cache import CACHE_ENV, cache_root
from raypipe.units import format_bytes, parse_bytes

logger = logging.getLogger("raypipe")

SUBDIRECTORY = "decoded"
LIMIT_ENV = "RAYPIPE_DECODED_LIMIT"
# np.load parses a .npy header with ast.literal_eval, and CPython 3.11 keeps the AST constructor's
# recursion count per interpreter: a garbage collection inside one thread's parse that lets another
# thread parse too fails one of them with "SystemError: AST constructor recursion depth mismatch"
# (python/cpython#106905). A stage's read-ahead thread and its step both open shards: one at a time.
_HEADER_LOCK = threading.Lock()
_EVICTED_BEFORE = False
# a copy being written is a ".partial" file; one this old was left by a writer that died mid-write
STALE_PARTIAL_S = 3600.0
_SWEPT: set[Path] = set()  # directories this process has swept of stale partial files


def decoded_dir() -> Path:
    """Where this process keeps decoded shards: ``<cache>/decoded`` (``$RAYPIPE_CACHE``, see :func:`cache_root`)."""
    return cache_root() / SUBDIRECTORY


def decoded_limit() -> int | None:
    """The most bytes of decoded copies a node keeps, ``$RAYPIPE_DECODED_LIMIT`` (e.g. ``500GB``); None: no limit."""
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise ValueError(f"{LIMIT_ENV}: {error}") from None


def writable_problem(directory: Path | None = None) -> str | None:
    """Why decoded shards cannot be written to ``directory`` (default :func:`decoded_dir`), or None."""
    directory = directory or decoded_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        return f"cannot write decoded shards to {directory} ({type(error).__name__}: {error})"
    return None


def open_decoded(sha256: str, row_length: int, decode: Callable[[], np.ndarray], source: str) -> np.ndarray:
    """The ``(rows, row_length)`` tokens of the shard whose file has ``sha256``, memory-mapped, read-only.

    ``decode()`` (which verifies and decodes ``source``) runs only when this
    node has no whole decoded copy yet. The copy holds each token in the
    smallest of uint16 and int32 that fits the shard's largest id.
    """
    path = decoded_dir() / f"{sha256}.npy"
    tokens = _mapped(path, row_length)
    if tokens is not None:
        _opened_now(path)
    else:
        limit = decoded_limit()  # a bad setting fails before the decode
        _store(path, decode(), source)
        tokens = _mapped(path, row_length)  # mapped before any removal: the mapping holds the file
        if tokens is None:  # written whole a moment ago: only a disk that loses data gets here
            raise OSError(f"the decoded copy of shard {source} at {path} cannot be read back")
        if limit is not None:
            evict_oldest(path.parent, limit, keep=path)
    return tokens


def _mapped(path: Path, row_length: int) -> np.ndarray | None:
    """The copy at ``path`` if it is whole and has rows of ``row_length``; else None (it is decoded again)."""
    try:
        with _HEADER_LOCK:  # mapping reads only the header: the lock is held for microseconds
            tokens = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None
    if tokens.ndim != 2 or tokens.shape[1] != row_length or tokens.dtype not in (np.uint16, np.int32):
        return None
    return tokens


def _opened_now(path: Path) -> None:
    """Mark the copy as opened now: removal under a limit goes by time of last open (the file's mtime)."""
    try:
        os.utime(path)
    except OSError:  # a cache another user owns, read-only: it is only the order of removal
        pass


def evict_oldest(directory: Path, limit: int, keep: Path) -> None:
    """Remove the least recently opened copies in ``directory`` until those left take at
    most ``limit`` bytes; ``keep`` (the copy just written) stays."""
    copies = []
    for copy in directory.glob("*.npy"):
        try:
            stat = copy.stat()
        except FileNotFoundError:  # removed by another reader on the node meanwhile
            continue
        copies.append((stat.st_mtime, stat.st_size, copy))
    total = sum(size for _, size, _ in copies)
    removed, removed_bytes = 0, 0
    for _, size, copy in sorted(copies):
        if total - removed_bytes <= limit:
            break
        if copy != keep:
            copy.unlink(missing_ok=True)
            removed, removed_bytes = removed + 1, removed_bytes + size
    if removed:
        global _EVICTED_BEFORE  # the first time in a process is a warning; each later one an info line
        logger.log(logging.INFO if _EVICTED_BEFORE else logging.WARNING,
                   "raypipe: removed %d decoded shard(s) (%s), the least recently opened, to keep %s under %s=%s; "
                   "a dataset larger than that is decoded again shard by shard", removed,
                   format_bytes(removed_bytes), directory, LIMIT_ENV, format_bytes(limit))
        _EVICTED_BEFORE = True


def _store(path: Path, tokens: np.ndarray, source: str) -> None:
    """Write ``tokens`` to ``path`` whole or not at all (a reader on this node may be writing it too)."""
    narrow = np.uint16 if tokens.size == 0 or int(tokens.max()) <= np.iinfo(np.uint16).max else np.int32
    _sweep_stale_partials(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".partial")
    except OSError as error:
        raise OSError(error.errno, _advice(path, source, error)) from None
    try:
        with os.fdopen(handle, "wb") as out:
            np.save(out, tokens.astype(narrow, copy=False))
        os.replace(temporary, path)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise OSError(error.errno, _advice(path, source, error)) from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _sweep_stale_partials(directory: Path) -> None:
    """Once per process and directory: remove the partial copies writers that died left behind
    (best effort: leftovers another reader swept first, or another user owns, are not this write's business)."""
    if directory in _SWEPT:
        return
    _SWEPT.add(directory)
    cutoff = time.time() - STALE_PARTIAL_S
    try:
        for partial in directory.glob(".*.partial"):
            with contextlib.suppress(OSError):
                if partial.stat().st_mtime < cutoff:
                    partial.unlink()
    except OSError:  # the directory itself cannot be listed: the write below says why
        pass


def _advice(path: Path, source: str, error: OSError) -> str:
    return (f"cannot write the decoded copy of shard {source} to {path} ({error.strerror or error}); readers keep "
            f"decoded shards on local disk (about 2 bytes per token): set {CACHE_ENV} to a writable local directory "
            "with room for the dataset")
