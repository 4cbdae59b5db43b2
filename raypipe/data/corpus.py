"""The text corpus to prepare: files under a path, or the running Python's standard library."""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from raypipe.data.shards import STDLIB_CORPUS

_SNIFF_BYTES = 8192  # a NUL byte among the first this many bytes marks a binary file


def stdlib_corpus_files() -> list[Path]:
    """All ``*.py`` files of the running interpreter's standard library, sorted.

    Installed packages (site-packages, dist-packages) are excluded, so the
    corpus is the same on every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in skip]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def corpus_files(corpus: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """The text files of ``corpus``: a file, a directory (recursively), or a list of them.

    ``None`` means the Python standard library. Inside directories, hidden
    entries and binary files (a NUL byte near the start) are skipped; files
    named explicitly are always used.
    """
    if corpus is None:
        return stdlib_corpus_files()
    items = [corpus] if isinstance(corpus, (str, Path)) else list(corpus)
    files: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            files.extend(_text_files_under(path))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"corpus path {path} does not exist")
    return files


def _text_files_under(directory: Path) -> list[Path]:
    files = []
    for current, subdirs, names in os.walk(directory):
        subdirs[:] = sorted(name for name in subdirs if not name.startswith("."))
        for name in sorted(names):
            path = Path(current, name)
            if not name.startswith(".") and path.is_file() and not _looks_binary(path):
                files.append(path)
    return files


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as handle:
        return b"\0" in handle.read(_SNIFF_BYTES)


def read_documents(files: Iterable[Path], max_bytes: int | None) -> Iterator[tuple[Path, str, int]]:
    """(path, text, bytes read) of each non-empty file, stopping once ``max_bytes`` are read."""
    remaining = max_bytes
    for path in files:
        if remaining is not None and remaining <= 0:
            return
        with open(path, "rb") as handle:
            data = handle.read() if remaining is None else handle.read(remaining)
        if remaining is not None:
            remaining -= len(data)
        if data:
            # A byte cap can split a character, and some corpora hold a few
            # non-UTF-8 files (the stdlib has latin-1 test data): replace, not fail.
            yield path, data.decode("utf-8", errors="replace"), len(data)


def corpus_description(corpus: str | Path | Sequence[str | Path] | None) -> str | list[str]:
    """How a manifest records ``corpus``: the stdlib's name, or the resolved paths."""
    if corpus is None:
        return STDLIB_CORPUS
    items = [corpus] if isinstance(corpus, (str, Path)) else list(corpus)
    return [str(Path(item).expanduser().resolve()) for item in items]
