"""Where files live: one pyarrow filesystem for local paths and URIs, used by
checkpoints and datasets alike."""
from __future__ import annotations

from pathlib import Path

from pyarrow import fs as pafs


def filesystem_for(uri: str | Path) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and path for a local path or a URI (s3://, gs://, file://)."""
    text = str(uri)
    if "://" not in text:
        # FileSystem.from_uri rejects relative paths; plain paths are local.
        return pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())
    filesystem, path = pafs.FileSystem.from_uri(text)
    return filesystem, path.rstrip("/")
