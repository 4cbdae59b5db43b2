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

from raypipe.data.shards import SPLITS, check_split_files, read_manifest, verify_split_files


def verify_dataset(path: str | Path) -> dict[str, dict[str, int]]:
    """Check every shard of every split against the manifest: there, its size, sha256, schema,
    rows, and every token id inside the vocabulary. Returns per split its ``shards``,
    ``rows`` and ``bytes``; the first bad shard raises ValueError naming the file."""
    manifest = read_manifest(path)
    counts = {}
    for split in SPLITS:
        check_split_files(path, manifest, split)
        size = verify_split_files(path, manifest, split, vocab_size=manifest["vocab_size"])
        shards = manifest["splits"][split]["shards"]
        counts[split] = {"shards": len(shards), "rows": sum(shard["num_rows"] for shard in shards), "bytes": size}
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
