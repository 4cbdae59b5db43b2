"""``raypipe verify-data``: read every shard of a prepared dataset once and check it whole.

Opening a :class:`~raypipe.data.TokenDataset` reads no shard (a job start
would otherwise download the whole corpus); each shard is checked where it is
first decoded, during training. This is the check to run once, where the
dataset was uploaded, before jobs use it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from raypipe.data.packing import check_boundaries, read_boundaries
from raypipe.data.shards import SPLITS, check_split_files, read_manifest, validation_rows, verify_split_files


def verify_dataset(path: str | Path) -> dict[str, dict[str, int]]:
    """Check every shard of every split against the manifest: there, its size, sha256, schema,
    rows, and every token id inside the vocabulary; in a packed dataset also every row's
    document boundaries (:class:`~raypipe.data.packing.PackedCheck`). Returns per split its
    ``shards``, ``rows`` and ``bytes``; the first bad shard raises ValueError naming the file."""
    manifest = read_manifest(path)
    packed = PackedCheck(manifest) if manifest.get("packed") else None
    counts = {}
    for split in SPLITS:
        check_split_files(path, manifest, split)
        if packed is not None:
            packed.split = split
        size = verify_split_files(path, manifest, split, vocab_size=manifest["vocab_size"], check=packed)
        shards = manifest["splits"][split]["shards"]
        counts[split] = {"shards": len(shards), "rows": sum(shard["num_rows"] for shard in shards), "bytes": size}
    if packed is not None:
        packed.finish(path)
    return counts


def add_verify_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``raypipe verify-data`` to ``parser``."""
    parser.add_argument("path", metavar="DATASET", help="prepared dataset (path or URI: s3://, gs://, file://)")
    return parser


def run_verify(args: argparse.Namespace) -> int:
    """Run ``raypipe verify-data`` with parsed ``args``; returns the exit status."""
    try:
        counts = verify_dataset(args.path)
    except (ValueError, OSError) as error:
        print(f"raypipe verify-data: error: {error}", file=sys.stderr)
        return 2
    splits = ", ".join(f"{split} {c['shards']} shards ({c['rows']} rows, {c['bytes']:,} bytes)"
                       for split, c in counts.items())
    print(f"{args.path}: {splits}: every shard is as the manifest says")
    return 0


class PackedCheck:
    """The boundaries of a packed dataset (:mod:`raypipe.data.packing`): each shard's rows as it
    is read (called with its path, bytes and tokens), then the whole corpus (:meth:`finish`): as
    many documents begun as the manifest counts, its padding, and every continuation going on
    from where its document stopped in the corpus's row before (the splits' rows put back in
    the corpus's order by the manifest's ``val_fraction`` and ``seed``)."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.row_length = manifest["seq_len"] + 1
        self.bos_id = manifest["tokenizer"].get("bos_id")
        self.source, self.params = manifest.get("source", {}), manifest.get("params", {})
        self.documents = self.padding = 0
        self.split = SPLITS[0]
        # per split, per row in order: (shard, row in the shard, its first piece's start, its last piece's end)
        self.rows: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
        self.paths: list[str] = []

    def __call__(self, path: str, data: pa.Buffer, tokens: np.ndarray) -> None:
        offsets, lengths, starts = read_boundaries(path, data)
        documents, padding = check_boundaries(path, tokens, offsets, lengths, starts, self.bos_id, self.row_length)
        self.documents += documents
        self.padding += padding
        count, last = len(offsets) - 1, offsets[1:] - 1
        self.rows[self.split].append(np.stack([np.full(count, len(self.paths)), np.arange(count),
                                               starts[offsets[:-1]], starts[last] + lengths[last]], axis=1))
        self.paths.append(path)

    def finish(self, dataset: object) -> None:
        """The checks over the whole corpus; the first failure raises ValueError."""
        expected = self.source.get("num_documents")
        if expected is not None and self.documents != expected:
            raise ValueError(f"dataset {dataset}: its rows begin {self.documents} documents, the manifest says "
                             f"{expected} (document boundaries are missing or extra)")
        if self.padding != self.source.get("padded_tokens", 0):
            raise ValueError(f"dataset {dataset}: its rows hold {self.padding} tokens of padding, the manifest says "
                             f"{self.source.get('padded_tokens', 0)} (only the corpus's last row may be short)")
        per_split = {split: np.concatenate(parts) if parts else np.empty((0, 4), dtype=np.int64)
                     for split, parts in self.rows.items()}
        total = sum(len(rows) for rows in per_split.values())
        is_validation = validation_rows(total, self.params.get("val_fraction", 0.0), self.params.get("seed", 0))
        if int(is_validation.sum()) != len(per_split["validation"]):
            raise ValueError(f"dataset {dataset}: {len(per_split['validation'])} validation rows, but its val_fraction "
                             f"and seed place {int(is_validation.sum())} of its {total} rows there")
        corpus = np.empty((total, 4), dtype=np.int64)
        corpus[is_validation], corpus[~is_validation] = per_split["validation"], per_split["train"]
        previous_end = np.concatenate([[0], corpus[:-1, 3]])
        broken = np.flatnonzero((corpus[:, 2] != 0) & (corpus[:, 2] != previous_end))
        if len(broken):
            row = int(broken[0])
            shard, in_shard, start = (int(value) for value in corpus[row, :3])
            before = (f"the row before it ({self.paths[int(corpus[row - 1, 0])]} row {int(corpus[row - 1, 1])}) "
                      f"stops at position {int(previous_end[row])}" if row else "it is the corpus's first row")
            raise ValueError(f"shard {self.paths[shard]} row {in_shard} continues a document at position {start}, "
                             f"but {before}: the positions are not consistent")
