"""Packed datasets: rows of whole documents with their boundaries, the reader's packed
micro-batches, and verify-data's check of the boundaries (no Ray)."""
from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raypipe.core.packed import IGNORE_INDEX, split_packed
from raypipe.data import TokenDataset, prepare
from raypipe.data.verify import verify_dataset

SEQ_LEN = 16
ROW = SEQ_LEN + 1
BOS, EOS, PAD = 256, 257, 258


@pytest.fixture(autouse=True)
def node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """Documents of random lengths: most shorter than a row, some several rows long."""
    directory = tmp_path_factory.mktemp("packing-corpus")
    generator = random.Random(7)
    paths = []
    for index in range(40):
        length = generator.choice([1, 3, 5, 9, 14]) if index % 5 else generator.randint(20, 60)
        path = directory / f"doc_{index:03d}.txt"
        path.write_bytes(bytes(generator.randrange(97, 123) for _ in range(length)))
        paths.append(path)
    return paths


def reference_rows(paths: list[Path]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Independently: the stream of <bos> bytes <eos>, each token with (document, position),
    cut into rows; the last row padded. Per row its tokens and (document, position) per token
    (document -1 for padding)."""
    stream: list[tuple[int, int, int]] = []
    for document, path in enumerate(paths):
        tokens = [BOS, *path.read_bytes(), EOS]
        stream += [(token, document, position) for position, token in enumerate(tokens)]
    stream += [(PAD, -1, 0)] * (-len(stream) % ROW)
    return [([t for t, _, _ in stream[i:i + ROW]], [(d, p) for _, d, p in stream[i:i + ROW]])
            for i in range(0, len(stream), ROW)]


def pieces(labels: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """A row's (lengths, starts) from its per-token (document, position), padding left out."""
    lengths, starts = [], []
    for index, (document, position) in enumerate(labels):
        if document < 0:
            continue
        if index == 0 or labels[index - 1][0] != document:
            lengths.append(0)
            starts.append(position)
        lengths[-1] += 1
    return lengths, starts


def read_split(dataset: Path, split: str = "train") -> list[dict]:
    manifest = json.loads((dataset / "manifest.json").read_text())
    rows = []
    for shard in manifest["splits"][split]["shards"]:
        rows += pq.read_table(dataset / shard["file"]).to_pylist()
    return rows


@pytest.fixture(scope="module")
def packed(corpus, tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("packed") / "data", corpus=corpus, seq_len=SEQ_LEN, val_fraction=0.0,
                   rows_per_shard=8, pack=True)


def test_packed_rows_hold_every_document_whole_with_their_boundaries(corpus, packed, tmp_path):
    reference = reference_rows(corpus)
    rows = read_split(packed)
    assert [row["tokens"] for row in rows] == [tokens for tokens, _ in reference]
    assert [(row["doc_lengths"], row["doc_starts"]) for row in rows] == [pieces(labels) for _, labels in reference]
    # some documents are split, and a continuation keeps its positions
    assert any(row["doc_starts"][0] > 0 for row in rows)
    manifest = json.loads((packed / "manifest.json").read_text())
    padding = sum(document < 0 for _, labels in reference for document, _ in labels)
    assert manifest["packed"] is True and manifest["params"]["pack"] is True
    assert 0 < padding < ROW and manifest["source"]["padded_tokens"] == padding
    assert rows[-1]["tokens"][-padding:] == [PAD] * padding and sum(rows[-1]["doc_lengths"]) == ROW - padding
    # the same tokens as the corpus unpacked, whose last (partial) row is dropped instead
    unpacked = prepare(tmp_path / "unpacked", corpus=corpus, seq_len=SEQ_LEN, val_fraction=0.0, rows_per_shard=8)
    assert [row["tokens"] for row in read_split(unpacked)] == [row["tokens"] for row in rows[:-1]]
    assert verify_dataset(packed)["train"]["rows"] == len(rows)


def test_reader_yields_positions_document_ids_and_targets_that_stay_in_their_document(corpus, packed):
    reference = reference_rows(corpus)
    reader = TokenDataset(packed, micro_batch_size=3, num_micro_batches=2)
    assert reader.packed
    for step in range(reader.steps_per_epoch):
        for micro_batch in range(2):
            inputs, targets = reader.get(step, micro_batch)
            tokens, positions, document_ids = split_packed(inputs)
            assert inputs.dtype == torch.int64 and inputs.shape == (3, 3, SEQ_LEN)
            for row, index in enumerate(reader.row_indices(step, micro_batch)):
                row_tokens, labels = reference[index]
                assert tokens[row].tolist() == row_tokens[:-1]
                assert positions[row].tolist() == [position if document >= 0 else 0
                                                   for document, position in labels[:-1]]
                # ids number the row's pieces from 0; equal ids exactly where the documents are equal
                ids = document_ids[row].tolist()
                assert ids[0] == 0 and all(b - a in (0, 1) for a, b in zip(ids, ids[1:]))
                assert all((ids[i] == ids[j]) == (labels[i][0] == labels[j][0])
                           for i in range(SEQ_LEN) for j in range(SEQ_LEN))
                expected = [row_tokens[t + 1] if labels[t + 1][0] == labels[t][0] >= 0 else IGNORE_INDEX
                            for t in range(SEQ_LEN)]
                assert targets[row].tolist() == expected


def test_cli_prepare_pack_and_verify(corpus, tmp_path, capsys):
    from raypipe.cli import main

    directory = corpus[0].parent
    assert main(["prepare", "--corpus", str(directory), "--out", str(tmp_path / "d"), "--seq-len", "16",
                 "--val-fraction", "0.2", "--pack"]) == 0
    assert "packed" in capsys.readouterr().out
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["packed"] is True
    assert main(["verify-data", str(tmp_path / "d")]) == 0


def corrupt(dataset: Path, tmp_path: Path, change) -> Path:
    """A copy of ``dataset`` whose first train shard has ``change(rows)`` applied, checksums updated."""
    data = tmp_path / "corrupt"
    shutil.copytree(dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    rows = pq.read_table(data / shard["file"]).to_pylist()
    change(rows)
    table = pa.table({"tokens": pa.array([row["tokens"] for row in rows], pa.list_(pa.int32(), ROW)),
                      "doc_lengths": pa.array([row["doc_lengths"] for row in rows], pa.list_(pa.int32())),
                      "doc_starts": pa.array([row["doc_starts"] for row in rows], pa.list_(pa.int32()))})
    pq.write_table(table, data / shard["file"])
    shard.update(sha256=hashlib.sha256((data / shard["file"]).read_bytes()).hexdigest(),
                 num_bytes=(data / shard["file"]).stat().st_size)
    (data / "manifest.json").write_text(json.dumps(manifest))
    return data


def first_row_with_two_pieces(rows: list[dict]) -> int:
    return next(index for index, row in enumerate(rows) if len(row["doc_lengths"]) >= 2)


def test_verify_data_names_the_row_of_a_corrupt_boundary(packed, tmp_path, capsys):
    from raypipe.cli import main

    def shift(rows):  # a boundary one token off: the lengths still sum to the row
        row = rows[first_row_with_two_pieces(rows)]
        row["doc_lengths"][0] -= 1
        row["doc_lengths"][1] += 1

    data = corrupt(packed, tmp_path, shift)
    row = first_row_with_two_pieces(read_split(packed))
    assert main(["verify-data", str(data)]) == 2
    first_line = capsys.readouterr().err.splitlines()[0]
    assert f"shard {data}/train-00000.parquet row {row}: a document begins at column" in first_line
    assert "not <bos> (256): the boundaries do not match the tokens" in first_line


@pytest.mark.parametrize("change, message", [
    (lambda row: row["doc_lengths"].__setitem__(0, row["doc_lengths"][0] + 1), "summing past the row length 17"),
    (lambda row: row["doc_starts"].__setitem__(1, 3), "a continuation piece (start > 0) that is not the row's first"),
    (lambda row: row["doc_lengths"].__setitem__(-1, 0), "has a piece of length < 1"),
], ids=["lengths-past-the-row", "continuation-not-first", "empty-piece"])
def test_verify_data_and_the_reader_catch_bad_boundaries(packed, tmp_path, change, message):
    def apply(rows):
        change(rows[first_row_with_two_pieces(rows)])

    data = corrupt(packed, tmp_path, apply)
    row = first_row_with_two_pieces(read_split(packed))
    with pytest.raises(ValueError, match=f"train-00000.parquet row {row} ") as raised:
        verify_dataset(data)
    assert message in str(raised.value)
    reader = TokenDataset(data, micro_batch_size=1, num_micro_batches=1)
    step = next(s for s in range(reader.steps_per_epoch) if reader.row_indices(s, 0)[0] < 8)  # a row of shard 0
    with pytest.raises(ValueError, match=f"train-00000.parquet row {row} "):
        reader.get(step, 0)


def test_lengths_that_fall_short_of_the_row_are_padding_the_manifest_does_not_record(packed, tmp_path):
    def drop_last_piece(rows):  # a row that looks padded, in the middle of the corpus
        row = rows[first_row_with_two_pieces(rows)]
        row["doc_lengths"].pop()
        row["doc_starts"].pop()

    with pytest.raises(ValueError, match="(documents|tokens of padding), the manifest says"):
        verify_dataset(corrupt(packed, tmp_path, drop_last_piece))


def test_a_packed_reader_pickles_and_resumes_to_the_same_batches(packed):
    import pickle

    reader = TokenDataset(packed, micro_batch_size=2, num_micro_batches=2, seed=3)
    first = reader.get(1, 1)
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.packed and not copy._mapped_codes
    for got, expected in zip(copy.get(1, 1), first):
        assert torch.equal(got, expected)


def test_verify_data_checks_that_a_continuation_goes_on_from_the_row_before(packed, tmp_path):
    rows = read_split(packed)
    row = next(index for index, row in enumerate(rows) if index < 8 and row["doc_starts"][0] > 0)
    expected = rows[row]["doc_starts"][0]
    assert expected == rows[row - 1]["doc_starts"][-1] + rows[row - 1]["doc_lengths"][-1]  # as prepared

    def skip_a_position(shard_rows):
        shard_rows[row]["doc_starts"][0] += 1

    message = (f"train-00000.parquet row {row} continues a document at position {expected + 1}, but the row "
               f"before it .*train-00000.parquet row {row - 1}\\) stops at position {expected}: the positions are "
               "not consistent")
    with pytest.raises(ValueError, match=message):
        verify_dataset(corrupt(packed, tmp_path, skip_a_position))
