"""Where jobs keep the datasets they prepare themselves: a per-user cache,
outside any job's working directory."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from pathlib import Path

from raypipe.data.shards import STDLIB_CORPUS

CACHE_ENV = "RAYPIPE_CACHE"


def cache_root() -> Path:
    """``$RAYPIPE_CACHE``, else ``$XDG_CACHE_HOME/raypipe``, else ``~/.cache/raypipe``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser().resolve() / "raypipe"


def default_dataset_dir(seq_len: int, corpus: str = STDLIB_CORPUS, tokenizer: str = "byte",
                        pack: bool = False) -> Path:
    """The directory a job prepares its default corpus in: ``<cache>/data/<corpus>-<tokenizer>-<hash>``.

    A job's working directory is a copy that Ray's runtime environment unpacks,
    and may remove, per job (and per node); a dataset prepared there can vanish
    under the stages reading it. ``tokenizer`` is the name a manifest records
    (``byte``, ``hf:DIRECTORY``). The hash covers everything that changes the
    tokens (sequence length; for the stdlib, the Python version that supplies
    it; whether documents are packed), so different datasets never share a directory.
    """
    key = {"corpus": corpus, "tokenizer": tokenizer, "seq_len": seq_len}
    if pack:  # only when packed: the unpacked datasets keep the directories they were prepared in
        key["pack"] = True
    if corpus == STDLIB_CORPUS:
        key["python"] = platform.python_version()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", tokenizer).strip("_")[:40]  # "hf:/a/b" -> "hf_a_b"
    return cache_root() / "data" / f"{corpus}-{label}-{digest}"
