"""Packed rows: whole documents back to back, their boundaries stored beside the tokens.

``prepare(pack=True)`` (``raypipe prepare --pack``) cuts the same stream of
``<bos> document <eos>`` tokens into the same fixed rows of ``seq_len + 1`` tokens
as an unpacked dataset, and stores with each row where its documents begin and end:

- ``tokens``: ``fixed_size_list<int32>[seq_len + 1]``, as unpacked;
- ``doc_lengths``: ``list<int32>``, the lengths of the row's pieces in order (a
  *piece* is a whole document, or the part of one that falls in this row);
- ``doc_starts``: ``list<int32>``, each piece's position in its document: 0 for a
  document's first piece; for a continuation (a document that crossed the end of
  the row before, which is then this row's first piece) the position it goes on
  from, so its tokens rotate as in the whole document.

A piece's token ``i`` has position ``doc_starts[p] + i``. Per piece, not per token:
two ints per piece instead of one per token. The lengths of a row sum to
``seq_len + 1``, except in the corpus's last row, which alone is padded (with the
tokenizer's ``pad_id``) and whose lengths sum to its real tokens; the manifest
records ``"packed": true`` and ``"padded_tokens"``.

Readers keep, beside a shard's decoded tokens, a decoded copy of its boundaries per
token (:func:`token_codes`: position + 1, 0 for padding), memory-mapped like the tokens.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

LENGTHS_COLUMN = "doc_lengths"
STARTS_COLUMN = "doc_starts"
CODES_SUFFIX = "-positions"  # a shard's decoded boundaries: the copy named by its sha256 and this


class RowPacker:
    """Cuts documents (already wrapped in <bos>/<eos>) into rows of ``row_length`` tokens
    and says, per row, its pieces' lengths and starting positions."""

    def __init__(self, row_length: int) -> None:
        self.row_length = row_length
        self._tokens = np.empty(0, dtype=np.int64)
        self._pieces: list[list[int]] = []  # [start position, length] of the tokens not yet in a row

    def add(self, document: np.ndarray) -> Iterator[tuple[np.ndarray, list[int], list[int]]]:
        """Append one document; yields ``(row, lengths, starts)`` for each row it completes."""
        if len(document) == 0:
            return
        self._tokens = np.concatenate([self._tokens, document])
        self._pieces.append([0, len(document)])
        full = len(self._tokens) // self.row_length
        for index in range(full):
            yield self._tokens[index * self.row_length:(index + 1) * self.row_length], *self._take_row()
        self._tokens = self._tokens[full * self.row_length:]

    def finish(self, pad_id: int) -> tuple[np.ndarray, list[int], list[int], int] | None:
        """The corpus's last row, padded with ``pad_id``, and how many tokens are padding; None if nothing is left."""
        if len(self._tokens) == 0:
            return None
        padding = self.row_length - len(self._tokens)
        row = np.concatenate([self._tokens, np.full(padding, pad_id, dtype=np.int64)])
        lengths, starts = [length for _, length in self._pieces], [start for start, _ in self._pieces]
        self._tokens, self._pieces = self._tokens[:0], []
        return row, lengths, starts, padding

    def _take_row(self) -> tuple[list[int], list[int]]:
        lengths, starts, room = [], [], self.row_length
        while room:
            start, length = self._pieces[0]
            taken = min(length, room)
            lengths.append(taken)
            starts.append(start)
            room -= taken
            if taken == length:
                self._pieces.pop(0)
            else:  # the rest continues the document in the next row, from where this piece ends
                self._pieces[0] = [start + taken, length - taken]
        return lengths, starts


def boundary_columns(lengths: list[list[int]], starts: list[list[int]]) -> dict[str, pa.Array]:
    """The ``doc_lengths`` and ``doc_starts`` columns of a shard's rows."""
    return {LENGTHS_COLUMN: pa.array(lengths, type=pa.list_(pa.int32())),
            STARTS_COLUMN: pa.array(starts, type=pa.list_(pa.int32()))}


def read_boundaries(path: str, data: pa.Buffer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A shard's pieces, flat: ``(offsets, lengths, starts)`` with row ``r``'s pieces at
    ``offsets[r]:offsets[r + 1]``; a missing column or a null is named."""
    schema = pq.ParquetFile(pa.BufferReader(data)).schema_arrow
    missing = [name for name in (LENGTHS_COLUMN, STARTS_COLUMN) if name not in schema.names]
    if missing:
        raise ValueError(f"shard {path} of a packed dataset lacks the column(s) {missing} "
                         f"(it has {schema.names}); prepare the dataset again with --pack")
    table = pq.read_table(pa.BufferReader(data), columns=[LENGTHS_COLUMN, STARTS_COLUMN])
    lengths = table.column(LENGTHS_COLUMN).combine_chunks()
    starts = table.column(STARTS_COLUMN).combine_chunks()
    for name, column in ((LENGTHS_COLUMN, lengths), (STARTS_COLUMN, starts)):
        if column.null_count or column.flatten().null_count:
            raise ValueError(f"shard {path} has a null in its {name!r} column")
    offsets = lengths.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    if not np.array_equal(offsets, starts.offsets.to_numpy(zero_copy_only=False)):
        row = int(np.flatnonzero(np.diff(offsets) != np.diff(starts.offsets.to_numpy(zero_copy_only=False)))[0])
        raise ValueError(f"shard {path} row {row}: {LENGTHS_COLUMN} and {STARTS_COLUMN} have different lengths")
    return (offsets - offsets[0], lengths.flatten().to_numpy(zero_copy_only=False).astype(np.int64),
            starts.flatten().to_numpy(zero_copy_only=False).astype(np.int64))


def check_boundaries(path: str, tokens: np.ndarray | None, offsets: np.ndarray, lengths: np.ndarray,
                     starts: np.ndarray, bos_id: int | None, row_length: int) -> tuple[int, int]:
    """Every row's pieces against its tokens: lengths >= 1 summing to the row length (less only
    in a padded row), starts >= 0, a continuation only as a row's first piece, and every
    document's first piece beginning with <bos> (given the ``(rows, row_length)`` tokens).
    Returns (documents begun, padded tokens); the first bad row is named with what is wrong."""
    rows = len(offsets) - 1
    if tokens is not None and len(tokens) != rows:
        raise ValueError(f"shard {path} has boundaries for {rows} rows and tokens for {len(tokens)}")
    row_of_piece = np.repeat(np.arange(rows), np.diff(offsets))
    first_piece = np.zeros(len(lengths), dtype=bool)
    first_piece[offsets[:-1][np.diff(offsets) > 0]] = True
    sums = np.zeros(rows, dtype=np.int64)
    np.add.at(sums, row_of_piece, lengths)
    ends = np.cumsum(lengths)
    column_of_piece = (ends - lengths) - np.concatenate([[0], ends])[offsets[:-1]][row_of_piece]
    problems = [
        (np.flatnonzero(np.diff(offsets) == 0), "has no pieces"),
        (np.unique(row_of_piece[lengths < 1]), "has a piece of length < 1"),
        (np.unique(row_of_piece[starts < 0]), "has a piece starting at a negative position"),
        (np.flatnonzero(sums > row_length), f"has piece lengths summing past the row length {row_length}"),
        (np.unique(row_of_piece[(starts > 0) & ~first_piece]),
         "has a continuation piece (start > 0) that is not the row's first piece"),
    ]
    for bad, what in problems:
        if len(bad):
            row = int(bad[0])
            pieces = f"lengths {lengths[offsets[row]:offsets[row + 1]].tolist()}, " \
                     f"starts {starts[offsets[row]:offsets[row + 1]].tolist()}"
            raise ValueError(f"shard {path} row {row} {what} ({pieces})")
    opening = (starts == 0) & (lengths >= 1)
    if tokens is not None and bos_id is not None and np.any(opening):
        first_tokens = tokens[row_of_piece[opening], column_of_piece[opening]]
        wrong = np.flatnonzero(first_tokens != bos_id)
        if len(wrong):
            row = int(row_of_piece[opening][wrong[0]])
            raise ValueError(f"shard {path} row {row}: a document begins at column "
                             f"{int(column_of_piece[opening][wrong[0]])} with token {int(first_tokens[wrong[0]])}, "
                             f"not <bos> ({bos_id}): the boundaries do not match the tokens")
    return int(opening.sum()), int((row_length - sums).sum())


def token_codes(offsets: np.ndarray, lengths: np.ndarray, starts: np.ndarray, rows: int,
                row_length: int) -> np.ndarray:
    """Per token of each row, its position in its document plus one; 0 marks padding."""
    codes = np.zeros((rows, row_length), dtype=np.int64)
    if len(lengths) == 0:
        return codes
    ends = np.cumsum(lengths)
    piece_begin = ends - lengths  # each piece's first token, counted over the whole shard
    row_of_piece = np.repeat(np.arange(rows), np.diff(offsets))
    row_begin = np.concatenate([[0], ends])[offsets[:-1]]  # each row's first token, over the shard
    token_piece = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(int(ends[-1])) - piece_begin[token_piece]
    columns = piece_begin[token_piece] - row_begin[row_of_piece[token_piece]] + within
    codes[row_of_piece[token_piece], columns] = starts[token_piece] + within + 1
    return codes


def rows_of_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(positions, document_ids, padding)`` of rows of :func:`token_codes`: positions (0 in
    padding), each token's piece numbered from 0 per row (the padding one piece), and
    whether each token is padding."""
    codes = codes.astype(np.int64)
    padding = codes == 0
    positions = np.where(padding, 0, codes - 1)
    begins = np.ones(codes.shape, dtype=bool)  # a new piece at column 0, and ...
    begins[:, 1:] = ((padding[:, 1:] != padding[:, :-1])  # ... where padding begins, and where
                     | (~padding[:, 1:] & (codes[:, 1:] != codes[:, :-1] + 1)))  # positions do not go on
    return positions, np.cumsum(begins, axis=1) - 1, padding

