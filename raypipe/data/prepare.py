"""`prepare`: a text corpus into Parquet token shards (atomic), and its CLI."""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.data.corpus import corpus_description, corpus_files, read_documents
from raypipe.data.packing import RowPacker, boundary_columns
from raypipe.data.shards import (
    COLUMN,
    DEFAULT_ROWS_PER_SHARD,
    FORMAT,
    is_validation_row,
    placement_phase,
    MANIFEST,
    SPLITS,
    VERSION,
    read_manifest,
    verify_split_files,
)
from raypipe.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer, tokenizer_name

logger = logging.getLogger(__name__)


# --- prepare -----------------------------------------------------------------


def prepare(
    out_dir: str | Path,
    corpus: str | Path | Sequence[str | Path] | None = None,
    seq_len: int = 256,
    tokenizer: Tokenizer | None = None,
    val_fraction: float = 0.05,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    seed: int = 0,
    max_bytes: int | None = None,
    pack: bool = False,
) -> Path:
    """Tokenize ``corpus`` into Parquet shards under ``out_dir`` and return ``out_dir``.

    ``corpus`` is a text file, a directory, a list of them, or None for the
    Python standard library; ``max_bytes`` caps how much of it is read. Each
    row holds ``seq_len + 1`` token ids; a deterministic ``val_fraction`` of
    rows (placement depends on ``seed``) forms the validation split. Output is
    built in a temporary directory next to ``out_dir`` and renamed into place
    when complete, so a failed run leaves no ``out_dir``; an existing dataset
    at ``out_dir`` is replaced only on success.

    ``pack`` stores, beside each row's tokens, where its documents begin and end
    (:mod:`raypipe.data.packing`), pads the corpus's last row instead of dropping
    it, and records ``"packed": true`` in the manifest: the reader then yields
    packed micro-batches (:mod:`raypipe.core.packed`) whose documents attend only
    to themselves.
    """
    tokenizer = tokenizer or ByteTokenizer()
    _check_prepare_arguments(seq_len, val_fraction, rows_per_shard, max_bytes)
    if not isinstance(pack, bool):
        raise ValueError(f"pack must be True or False, got {pack!r}")
    out = Path(out_dir).expanduser().resolve()
    _check_replaceable(out)
    files = corpus_files(corpus)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        stats = _write_shards(staging, files, tokenizer, seq_len, val_fraction, rows_per_shard, seed, max_bytes, pack)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": {
                "name": tokenizer_name(tokenizer),
                "bos_id": tokenizer.bos_id,
                "eos_id": tokenizer.eos_id,
                "pad_id": tokenizer.pad_id,
            },
            "vocab_size": int(tokenizer.vocab_size),
            "seq_len": seq_len,
            "row_length": seq_len + 1,
            "column": COLUMN,
            "packed": pack,
            "splits": stats.pop("splits"),
            "source": stats,
            "params": {
                "corpus": corpus_description(corpus),
                "seq_len": seq_len,
                "tokenizer": tokenizer_name(tokenizer),
                "val_fraction": val_fraction,
                "rows_per_shard": rows_per_shard,
                "seed": seed,
                "max_bytes": max_bytes,
                "pack": pack,
            },
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _install(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _check_prepare_arguments(seq_len: int, val_fraction: float, rows_per_shard: int, max_bytes: int | None) -> None:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if not isinstance(rows_per_shard, int) or rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be a positive int, got {rows_per_shard!r}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a directory that is not an earlier prepared dataset."""
    if out.exists() and not (out / MANIFEST).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"{out} exists and is not a prepared dataset (no {MANIFEST}); "
            "choose another --out or remove it"
        )


def _install(staging: Path, out: Path) -> None:
    """Move the finished ``staging`` directory to ``out``, replacing an old dataset."""
    _check_replaceable(out)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.rename(staging, out)
        return
    retired = out.with_name(f".{out.name}.old-{uuid.uuid4().hex}")
    os.rename(out, retired)
    os.rename(staging, out)
    shutil.rmtree(retired, ignore_errors=True)


class _SplitWriter:
    """Buffers the rows of one split and writes them as checksummed Parquet shards."""

    def __init__(self, directory: Path, split: str, row_length: int, rows_per_shard: int) -> None:
        self.directory = directory
        self.split = split
        self.row_length = row_length
        self.rows_per_shard = rows_per_shard
        self.pending: list[np.ndarray] = []
        self.pending_lengths: list[list[int]] = []  # packed: each row's pieces (raypipe.data.packing)
        self.pending_starts: list[list[int]] = []
        self.pending_rows = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, row: np.ndarray, lengths: list[int] | None = None, starts: list[int] | None = None) -> None:
        self.pending.append(row)
        if lengths is not None:
            self.pending_lengths.append(lengths)
            self.pending_starts.append(starts)
        self.pending_rows += 1
        if self.pending_rows == self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        rows = np.stack(self.pending).astype(np.int32, copy=False)
        values = pa.array(rows.reshape(-1), type=pa.int32())
        columns = {COLUMN: pa.FixedSizeListArray.from_arrays(values, self.row_length)}
        if self.pending_lengths:
            columns.update(boundary_columns(self.pending_lengths, self.pending_starts))
        table = pa.table(columns)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue()
        name = f"{self.split}-{len(self.shards):05d}.parquet"
        (self.directory / name).write_bytes(memoryview(data))
        self.shards.append(
            {"file": name, "num_rows": len(rows), "num_bytes": data.size,
             "sha256": hashlib.sha256(memoryview(data)).hexdigest()}
        )
        self.pending, self.pending_lengths, self.pending_starts, self.pending_rows = [], [], [], 0

    def summary(self) -> dict[str, Any]:
        self.flush()
        return {"num_rows": sum(shard["num_rows"] for shard in self.shards), "shards": self.shards}


def _write_shards(
    directory: Path,
    files: list[Path],
    tokenizer: Tokenizer,
    seq_len: int,
    val_fraction: float,
    rows_per_shard: int,
    seed: int,
    max_bytes: int | None,
    pack: bool = False,
) -> dict[str, Any]:
    row_length = seq_len + 1
    writers = {split: _SplitWriter(directory, split, row_length, rows_per_shard) for split in SPLITS}
    # Row i is a validation row when floor(i*f + phase) steps up: exactly a
    # fraction f of rows, spread evenly, placed by the seed.
    phase = placement_phase(seed)
    carry = np.empty(0, dtype=np.int64)
    packer = RowPacker(row_length) if pack else None
    documents = total_bytes = total_tokens = rows = padded = 0

    def place(row: np.ndarray, *boundaries: list[int]) -> None:
        nonlocal rows
        writers["validation" if is_validation_row(rows, val_fraction, phase) else "train"].add(row, *boundaries)
        rows += 1

    for path, text, size in read_documents(files, max_bytes):
        ids = _encode(tokenizer, text, path)
        documents += 1
        total_bytes += size
        total_tokens += len(ids) + 2
        document = np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]]).astype(np.int64)
        if packer is not None:
            for row, lengths, starts in packer.add(document):
                place(row, lengths, starts)
            continue
        carry = np.concatenate([carry, document])
        full = len(carry) // row_length
        for row in carry[: full * row_length].reshape(full, row_length):
            place(row)
        carry = carry[full * row_length:]
    last = packer.finish(tokenizer.pad_id) if packer is not None else None
    if last is not None:  # packed: the corpus's last row is padded, not dropped
        row, lengths, starts, padded = last
        place(row, lengths, starts)
    if documents == 0:
        raise ValueError(f"the corpus is empty: no non-empty text files among {len(files)} file(s)")
    splits = {split: writer.summary() for split, writer in writers.items()}
    _check_splits(splits, total_tokens, row_length, val_fraction)
    return {
        "splits": splits,
        "num_documents": documents,
        "num_bytes": total_bytes,
        "num_tokens": total_tokens,
        "dropped_tokens": int(len(carry)),
        **({"padded_tokens": padded} if pack else {}),
    }


def _encode(tokenizer: Tokenizer, text: str, path: Path) -> np.ndarray:
    """Token ids of one document, checked against the tokenizer's vocabulary."""
    if type(tokenizer) is ByteTokenizer:
        # Same ids as ByteTokenizer.encode, without a Python list per byte
        # (not for subclasses, which may encode differently).
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= tokenizer.vocab_size))
    if bad.size:
        raise ValueError(
            f"tokenizer {tokenizer_name(tokenizer)!r} returned id {int(ids[bad[0]])} at token "
            f"{int(bad[0])} of {path}, outside its vocabulary [0, {tokenizer.vocab_size})"
        )
    return ids


def _check_splits(splits: dict[str, Any], total_tokens: int, row_length: int, val_fraction: float) -> None:
    rows = sum(split["num_rows"] for split in splits.values())
    if rows == 0:
        raise ValueError(
            f"the corpus is too small: {total_tokens} tokens make no row of seq_len+1 = {row_length} tokens"
        )
    if val_fraction > 0 and (splits["validation"]["num_rows"] == 0 or splits["train"]["num_rows"] == 0):
        raise ValueError(
            f"the corpus is too small for a train/validation split: {rows} rows of {row_length} tokens "
            f"with val_fraction={val_fraction}; use a larger corpus, a smaller seq_len or val_fraction=0"
        )


def ensure_prepared(out_dir: str | Path, **kwargs: Any) -> Path:
    """``out_dir`` if it holds a valid dataset made with the given ``prepare`` arguments, else prepare it.

    Only arguments passed here are compared with those recorded in the
    manifest, so ``ensure_prepared(path)`` accepts any valid dataset.
    """
    out = Path(out_dir).expanduser().resolve()
    if (out / MANIFEST).is_file():
        try:
            manifest = read_manifest(out)
            for split in SPLITS:
                verify_split_files(out, manifest, split)
        except (ValueError, OSError) as error:
            logger.warning("re-preparing %s: %s", out, error)
        else:
            differences = _parameter_differences(manifest["params"], kwargs)
            if not differences:
                return out
            logger.warning("re-preparing %s: %s", out, "; ".join(differences))
    return prepare(out, **kwargs)


def _parameter_differences(recorded: dict[str, Any], requested: dict[str, Any]) -> list[str]:
    differences = []
    for key, value in requested.items():
        if key == "corpus":
            value = corpus_description(value)
        elif key == "pack" and "pack" not in recorded:  # made before packing existed: unpacked
            recorded = {**recorded, "pack": False}
        elif key == "tokenizer":
            value = tokenizer_name(value) if value is not None else "byte"
        if recorded.get(key) != value:
            differences.append(f"{key} is {recorded.get(key)!r}, wanted {value!r}")
    return differences


# --- CLI ---------------------------------------------------------------------


def add_prepare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``raypipe prepare`` to ``parser``."""
    parser.add_argument("--corpus", action="append", metavar="PATH",
                        help="text file or directory (repeatable); default: the Python standard library")
    parser.add_argument("--out", required=True, metavar="DIR", help="dataset directory to create")
    parser.add_argument("--seq-len", type=int, default=256, metavar="N", help="tokens per training sequence")
    parser.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                        help="fraction of rows held out for validation")
    parser.add_argument("--rows-per-shard", type=int, default=DEFAULT_ROWS_PER_SHARD, metavar="N")
    parser.add_argument("--seed", type=int, default=0, help="places the validation rows")
    parser.add_argument("--max-bytes", type=int, default=None, metavar="N", help="read at most N bytes of the corpus")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="Hugging Face tokenizer directory (tokenizer.json); default: bytes")
    parser.add_argument("--pack", action="store_true",
                        help="store each row's document boundaries, so documents attend only to themselves")
    parser.add_argument("--if-missing", action="store_true",
                        help="keep an existing dataset made with the same arguments")
    return parser


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``raypipe prepare`` with parsed ``args``; returns the exit status."""
    build = ensure_prepared if args.if_missing else prepare
    try:
        out = build(
            args.out,
            corpus=args.corpus,
            seq_len=args.seq_len,
            tokenizer=get_tokenizer(f"hf:{args.tokenizer}") if args.tokenizer else None,
            val_fraction=args.val_fraction,
            rows_per_shard=args.rows_per_shard,
            seed=args.seed,
            max_bytes=args.max_bytes,
            pack=args.pack,
        )
    except (ValueError, OSError) as error:
        print(f"raypipe prepare: error: {error}", file=sys.stderr)
        return 2
    manifest = read_manifest(out)
    splits = manifest["splits"]
    print(
        f"prepared {out}: {manifest['source']['num_documents']} documents, "
        f"train {splits['train']['num_rows']} rows, validation {splits['validation']['num_rows']} rows "
        f"of {manifest['seq_len']}+1 tokens (tokenizer {manifest['tokenizer']['name']}, "
        f"vocab {manifest['vocab_size']}{', packed' if manifest.get('packed') else ''})"
    )
    return 0

