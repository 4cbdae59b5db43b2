"""Token data: prepare, shards and manifest, the deterministic resumable reader, bad data."""
from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import shutil
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raypipe.data import (
    TokenDataset,
    add_prepare_arguments,
    ensure_prepared,
    prepare,
    run_prepare,
    stdlib_corpus_files,
)
from raypipe.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer

SEQ_LEN = 16
ROW = SEQ_LEN + 1
BOS, EOS = 256, 257


def write_corpus(directory: Path, documents: int = 30) -> list[Path]:
    """Distinct text files, so every row of the dataset is unique."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(documents):
        path = directory / f"doc_{index:03d}.txt"
        path.write_text(f"document {index}: " + " ".join(f"w{index}_{k} é" for k in range(index % 7 + 3)))
        paths.append(path)
    return paths


def reference_rows(paths: list[Path]) -> list[tuple[int, ...]]:
    """Rows computed independently: <bos> bytes <eos> per file, concatenated, cut into ROW tokens."""
    stream: list[int] = []
    for path in paths:
        stream += [BOS, *path.read_bytes(), EOS]
    return [tuple(stream[start:start + ROW]) for start in range(0, len(stream) - ROW + 1, ROW)]


def shard_rows(dataset_dir: Path, split: str) -> list[tuple[int, ...]]:
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    rows = []
    for shard in manifest["splits"][split]["shards"]:
        rows += [tuple(row) for row in pq.read_table(dataset_dir / shard["file"]).column("tokens").to_pylist()]
    return rows


@pytest.fixture(autouse=True)
def node_cache(tmp_path, monkeypatch):
    """Each test on a node of its own: no shard decoded yet, so every shard read is checked."""
    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[Path]]:
    directory = tmp_path_factory.mktemp("corpus")
    return directory, write_corpus(directory)


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    return prepare(out, corpus=corpus[0], seq_len=SEQ_LEN, val_fraction=0.1, rows_per_shard=16)


# --- tokenizer -----------------------------------------------------------------


def test_byte_tokenizer_round_trips_text_and_reserves_special_ids():
    tokenizer = ByteTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    text = "héllo wörld ✓\n"
    assert tokenizer.encode(text) == list(text.encode("utf-8"))
    assert tokenizer.decode([tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]) == text
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (256, 257, 258, 259)
    with pytest.raises(ValueError, match="token id 300 at position 1"):
        tokenizer.decode([65, 300])
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        get_tokenizer("nope")


# --- prepare -------------------------------------------------------------------


def test_prepare_writes_the_corpus_tokens_as_rows(corpus, dataset):
    _, paths = corpus
    expected = reference_rows(paths)
    position = {row: index for index, row in enumerate(expected)}
    assert len(position) == len(expected), "test corpus rows must be unique"
    train, validation = shard_rows(dataset, "train"), shard_rows(dataset, "validation")
    # Every row lands in exactly one split, in corpus order within each split.
    assert sorted(position[row] for row in train + validation) == list(range(len(expected)))
    for rows in (train, validation):
        indices = [position[row] for row in rows]
        assert indices == sorted(indices)
    assert len(validation) == pytest.approx(0.1 * len(expected), abs=1)

    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["tokenizer"]["name"] == "byte"
    assert (manifest["vocab_size"], manifest["seq_len"]) == (259, SEQ_LEN)
    assert manifest["source"]["num_documents"] == len(paths)
    assert manifest["source"]["num_bytes"] == sum(path.stat().st_size for path in paths)
    for split, rows in (("train", train), ("validation", validation)):
        entry = manifest["splits"][split]
        assert entry["num_rows"] == len(rows)
        for shard in entry["shards"]:
            data = (dataset / shard["file"]).read_bytes()
            assert shard["sha256"] == hashlib.sha256(data).hexdigest()
            table = pq.read_table(dataset / shard["file"])
            assert table.num_rows == shard["num_rows"] <= 16
            assert table.schema.field("tokens").type == pa.list_(pa.int32(), ROW)


def test_prepare_is_deterministic_and_the_seed_places_validation_rows(corpus, dataset, tmp_path):
    again = prepare(tmp_path / "again", corpus=corpus[0], seq_len=SEQ_LEN, val_fraction=0.1, rows_per_shard=16)
    assert (again / "manifest.json").read_text() == (dataset / "manifest.json").read_text()
    other_seed = prepare(tmp_path / "seed", corpus=corpus[0], seq_len=SEQ_LEN, val_fraction=0.1,
                         rows_per_shard=16, seed=3)
    assert shard_rows(other_seed, "validation") != shard_rows(dataset, "validation")
    assert len(shard_rows(other_seed, "validation")) == pytest.approx(len(shard_rows(dataset, "validation")), abs=1)


def test_prepare_defaults_to_the_stdlib_and_caps_bytes(tmp_path):
    files = stdlib_corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = {path.relative_to(stdlib).as_posix() for path in files}
    assert {"os.py", "json/__init__.py"} <= names
    assert not any("site-packages" in name for name in names)
    assert [path.relative_to(stdlib).as_posix() for path in files] == sorted(names)

    out = prepare(tmp_path / "stdlib", seq_len=64, max_bytes=100_000)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["params"]["corpus"] == "python-stdlib"
    assert manifest["source"]["num_bytes"] == 100_000
    rows = shard_rows(out, "train") + shard_rows(out, "validation")
    assert len(rows) == (manifest["source"]["num_tokens"] - manifest["source"]["dropped_tokens"]) // 65
    # The first row of the corpus is <bos> and the first stdlib file's bytes.
    first = [BOS, *files[0].read_bytes()[:64]]
    assert first in [list(row) for row in rows]


def test_empty_or_tiny_corpus_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="corpus is empty: no non-empty text files among 0"):
        prepare(tmp_path / "out", corpus=empty)
    (empty / "blank.txt").write_text("")
    with pytest.raises(ValueError, match="corpus is empty"):
        prepare(tmp_path / "out", corpus=empty)
    (empty / "short.txt").write_text("hi")
    with pytest.raises(ValueError, match="too small: 4 tokens make no row of seq_len\\+1 = 17"):
        prepare(tmp_path / "out", corpus=empty, seq_len=SEQ_LEN)
    with pytest.raises(FileNotFoundError, match="corpus path .*missing does not exist"):
        prepare(tmp_path / "out", corpus=tmp_path / "missing")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty"]


class ExplodingTokenizer(ByteTokenizer):
    """Fails on the n-th document, after earlier shards are already written."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls = fail_at, 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("tokenizer crashed")
        return super().encode(text)


def test_interrupted_prepare_leaves_nothing_half_written(corpus, dataset, tmp_path):
    before = sorted(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        prepare(tmp_path / "out", corpus=corpus[0], seq_len=SEQ_LEN, rows_per_shard=2,
                tokenizer=ExplodingTokenizer(fail_at=20))
    assert sorted(tmp_path.iterdir()) == before

    # A failed re-prepare keeps the previous dataset intact.
    previous = tmp_path / "kept"
    prepare(previous, corpus=corpus[0], seq_len=SEQ_LEN, val_fraction=0.1)
    manifest = (previous / "manifest.json").read_text()
    with pytest.raises(RuntimeError):
        prepare(previous, corpus=corpus[0], seq_len=8, tokenizer=ExplodingTokenizer(fail_at=20))
    assert (previous / "manifest.json").read_text() == manifest
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kept"]
    TokenDataset(previous, micro_batch_size=2, num_micro_batches=2).get(0, 0)


def test_prepare_refuses_to_replace_a_directory_that_is_not_a_dataset(corpus, tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="precious exists and is not a prepared dataset"):
        prepare(tmp_path / "precious", corpus=corpus[0], seq_len=SEQ_LEN)
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_tokenizer_ids_outside_its_vocabulary_name_the_document(corpus, tmp_path):
    class Broken(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            return [1, 2, 999]

    with pytest.raises(ValueError, match="returned id 999 at token 2 of .*doc_000.txt"):
        prepare(tmp_path / "out", corpus=corpus[0], seq_len=SEQ_LEN, tokenizer=Broken())


def test_ensure_prepared_reuses_a_matching_dataset_only(corpus, tmp_path):
    out = tmp_path / "data"
    ensure_prepared(out, corpus=corpus[0], seq_len=SEQ_LEN, val_fraction=0.1)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    ensure_prepared(out, corpus=corpus[0], seq_len=SEQ_LEN)
    ensure_prepared(out)
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    ensure_prepared(out, corpus=corpus[0], seq_len=8, val_fraction=0.1)
    assert json.loads((out / "manifest.json").read_text())["seq_len"] == 8
    # A corrupted shard makes the dataset invalid, so it is prepared again.
    shard = out / "train-00000.parquet"
    shard.write_bytes(b"garbage")
    ensure_prepared(out, corpus=corpus[0], seq_len=8, val_fraction=0.1)
    TokenDataset(out, micro_batch_size=2, num_micro_batches=2).get(0, 0)


def test_cli_prepare(corpus, tmp_path, capsys):
    parser = add_prepare_arguments(argparse.ArgumentParser(prog="raypipe prepare"))
    args = parser.parse_args(["--corpus", str(corpus[0]), "--out", str(tmp_path / "cli"), "--seq-len", "16",
                              "--val-fraction", "0.1"])
    assert run_prepare(args) == 0
    assert "train" in capsys.readouterr().out
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text())["seq_len"] == 16
    (tmp_path / "void").mkdir()
    assert run_prepare(parser.parse_args(["--corpus", str(tmp_path / "void"), "--out", str(tmp_path / "x")])) == 2
    assert "corpus is empty" in capsys.readouterr().err


# --- reader --------------------------------------------------------------------


def test_reader_returns_shifted_rows_of_the_split(dataset):
    reader = TokenDataset(dataset, micro_batch_size=3, num_micro_batches=2)
    train = set(shard_rows(dataset, "train"))
    inputs, targets = reader.get(0, 1)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (3, SEQ_LEN)
    for row_inputs, row_targets in zip(inputs.tolist(), targets.tolist()):
        assert row_inputs[1:] == row_targets[:-1]
        assert tuple(row_inputs + row_targets[-1:]) in train
    batch_inputs, batch_targets = reader.global_batch(0)
    assert torch.equal(batch_inputs, torch.cat([reader.get(0, 0)[0], inputs]))
    assert torch.equal(batch_targets, torch.cat([reader.get(0, 0)[1], targets]))
    assert reader.tokens_per_step == 6 * SEQ_LEN
    assert reader.num_rows == len(train)

    validation = TokenDataset(dataset, split="validation", micro_batch_size=2, num_micro_batches=1)
    rows = set(shard_rows(dataset, "validation"))
    inputs, targets = validation.get(0, 0)
    assert all(tuple(i + t[-1:]) in rows for i, t in zip(inputs.tolist(), targets.tolist()))


def test_reader_is_deterministic_across_instances_pickles_and_uris(dataset):
    first = TokenDataset(dataset, micro_batch_size=2, num_micro_batches=6, seed=7)
    second = TokenDataset(f"file://{dataset}", micro_batch_size=2, num_micro_batches=6, seed=7)
    first.get(0, 0)  # fill the shard cache before pickling
    copy = pickle.loads(pickle.dumps(first))
    assert len(pickle.dumps(first)) < 8_000, "loaded shards must not be pickled"
    for step in (0, 1, 5, 40):
        for micro_batch in range(6):
            expected = first.get(step, micro_batch)
            for other in (second, copy):
                got = other.get(step, micro_batch)
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    other_seed = TokenDataset(dataset, micro_batch_size=2, num_micro_batches=6, seed=8)
    assert not torch.equal(other_seed.global_batch(0)[0], first.global_batch(0)[0])


def test_an_epoch_never_repeats_a_row_and_micro_batches_are_disjoint(dataset):
    reader = TokenDataset(dataset, micro_batch_size=2, num_micro_batches=6)
    steps = reader.steps_per_epoch
    assert steps == reader.num_rows // 12

    def epoch_rows(epoch: int) -> list[tuple[int, ...]]:
        rows = []
        for step in range(epoch * steps, (epoch + 1) * steps):
            for micro_batch in range(6):
                inputs, targets = reader.get(step, micro_batch)
                rows += [tuple(i + t[-1:]) for i, t in zip(inputs.tolist(), targets.tolist())]
        return rows

    first, second = epoch_rows(0), epoch_rows(1)
    for rows in (first, second):
        assert len(rows) == len(set(rows)) == steps * 12
        assert set(rows) <= set(shard_rows(dataset, "train"))
    assert first != second, "each epoch has its own order"


def test_reader_resumes_exactly_from_a_saved_position(dataset):
    reader = TokenDataset(dataset, micro_batch_size=2, num_micro_batches=2, seed=1)
    for _ in range(reader.steps_per_epoch + 2):  # cross an epoch boundary
        reader.global_batch(reader.next_step)
        reader.advance()
    state = json.loads(json.dumps(reader.state_dict()))
    assert state["next_step"] == reader.steps_per_epoch + 2 and state["seed"] == 1

    resumed = TokenDataset(dataset, micro_batch_size=2, num_micro_batches=2)
    resumed.load_state_dict(state)
    for _ in range(3):
        expected, got = reader.global_batch(reader.next_step), resumed.global_batch(resumed.next_step)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        reader.advance(), resumed.advance()
    with pytest.raises(ValueError, match="saved data position has rows_per_step=4, this reader has 6"):
        TokenDataset(dataset, micro_batch_size=3, num_micro_batches=2).load_state_dict(state)


def test_reader_argument_errors(dataset):
    with pytest.raises(ValueError, match="split must be one of"):
        TokenDataset(dataset, split="test")
    with pytest.raises(ValueError, match="fewer than one step needs"):
        TokenDataset(dataset, micro_batch_size=1000)
    with pytest.raises(FileNotFoundError, match="no dataset at"):
        TokenDataset(dataset.parent / "nothing")
    reader = TokenDataset(dataset, micro_batch_size=2, num_micro_batches=2)
    with pytest.raises(ValueError, match="micro_batch must be in \\[0, 2\\), got 2"):
        reader.get(0, 2)


# --- bad shards ----------------------------------------------------------------


def single_shard_dataset(corpus, tmp_path) -> Path:
    return prepare(tmp_path / "data", corpus=corpus[0], seq_len=SEQ_LEN, val_fraction=0.1, rows_per_shard=10_000)


def replace_shard(dataset_dir: Path, table: pa.Table) -> str:
    """Overwrite train shard 0 with ``table`` and record its checksum and size, as prepare would."""
    name = "train-00000.parquet"
    pq.write_table(table, dataset_dir / name)
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0].update(
        sha256=hashlib.sha256((dataset_dir / name).read_bytes()).hexdigest(), num_rows=table.num_rows,
        num_bytes=(dataset_dir / name).stat().st_size)
    manifest["splits"]["train"]["num_rows"] = table.num_rows
    (dataset_dir / "manifest.json").write_text(json.dumps(manifest))
    return name


def first_read(dataset_dir: Path) -> None:
    TokenDataset(dataset_dir, micro_batch_size=1, num_micro_batches=1).get(0, 0)


def test_token_id_outside_the_vocabulary_names_file_and_row(corpus, tmp_path):
    data = single_shard_dataset(corpus, tmp_path)
    rows = shard_rows(data, "train")
    rows[5] = rows[5][:3] + (300,) + rows[5][4:]
    replace_shard(data, pa.table({"tokens": pa.array(rows, pa.list_(pa.int32(), ROW))}))
    reader = TokenDataset(data, micro_batch_size=2, num_micro_batches=1)
    with pytest.raises(ValueError, match=r"train-00000.parquet row 5 holds token id 300, outside the vocabulary \[0, 259\)"):
        reader.get(0, 0)
    # A model vocabulary smaller than the data's is caught the same way.
    small = TokenDataset(data, split="validation", micro_batch_size=1, num_micro_batches=1, vocab_size=100)
    with pytest.raises(ValueError, match=r"validation-00000.parquet row \d+ holds token id \d+, outside the vocabulary \[0, 100\)"):
        small.get(0, 0)


def test_wrong_schema_names_the_file_at_its_first_read(corpus, tmp_path):
    data = single_shard_dataset(corpus, tmp_path)
    rows = shard_rows(data, "train")
    name = replace_shard(data, pa.table({"ids": pa.array(rows, pa.list_(pa.int32()))}))
    with pytest.raises(ValueError, match=f"{name} has the wrong schema: columns \\['ids'\\]"):
        first_read(data)
    replace_shard(data, pa.table({"tokens": pa.array([[float(t) for t in row] for row in rows], pa.list_(pa.float32()))}))
    with pytest.raises(ValueError, match=f"{name} has the wrong schema: column 'tokens' is list<.*float>"):
        first_read(data)
    replace_shard(data, pa.table({"tokens": pa.array([row[:-1] for row in rows], pa.list_(pa.int32(), ROW - 1))}))
    with pytest.raises(ValueError, match=f"{name} has the wrong schema: rows of 16 tokens, expected seq_len\\+1 = 17"):
        first_read(data)


def test_row_of_the_wrong_length_names_file_and_row(corpus, tmp_path):
    data = single_shard_dataset(corpus, tmp_path)
    rows = [list(row) for row in shard_rows(data, "train")]
    rows[2] = rows[2][:-1]
    replace_shard(data, pa.table({"tokens": pa.array(rows, pa.list_(pa.int32()))}))
    reader = TokenDataset(data, micro_batch_size=1, num_micro_batches=1)
    with pytest.raises(ValueError, match="train-00000.parquet row 2 has 16 tokens, expected seq_len\\+1 = 17"):
        reader.get(0, 0)


def test_opening_reads_no_shard_and_a_changed_one_fails_its_checksum_at_its_first_read(dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    shard = data / "train-00001.parquet"
    changed = bytearray(shard.read_bytes())
    changed[len(changed) // 2] ^= 0xFF  # the same size: only a read of every byte can tell
    shard.write_bytes(bytes(changed))
    reader = TokenDataset(data, micro_batch_size=1, num_micro_batches=1)  # opens: it lists the shards, reads none
    start = reader.shards[0]["num_rows"]  # shard 1's rows, split-wide
    rows_of_shard = range(start, start + reader.shards[1]["num_rows"])
    step = next(step for step in range(reader.steps_per_epoch) if reader.row_indices(step, 0)[0] in rows_of_shard)
    with pytest.raises(ValueError, match=f"checksum mismatch for shard .*{shard.name}.*prepare the dataset again"):
        reader.get(step, 0)


def test_opening_names_a_missing_or_resized_shard(dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    shard = data / "train-00001.parquet"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-10])  # an upload cut short
    with pytest.raises(ValueError, match=f"shard .*{shard.name} has {size - 10} bytes, the manifest says {size}"):
        TokenDataset(data)
    shard.unlink()
    with pytest.raises(ValueError, match=f"shard .*{shard.name} of the train split is missing"):
        TokenDataset(data)
    (data / "validation-00000.parquet").unlink()
    with pytest.raises(ValueError, match="validation-00000.parquet of the validation split is missing"):
        TokenDataset(data, split="validation", micro_batch_size=1, num_micro_batches=1)


def test_a_manifest_without_sizes_is_still_read(dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            del shard["num_bytes"]  # as raypipe wrote manifests before it recorded sizes
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert TokenDataset(data, micro_batch_size=2, num_micro_batches=2).global_batch(0)[0].shape == (4, SEQ_LEN)


def test_verify_data_reads_every_shard_and_names_the_first_bad_one(dataset, tmp_path, capsys):
    from raypipe.cli import main

    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    assert main(["verify-data", str(data)]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    assert f"train {len(train['shards'])} shards ({train['num_rows']} rows" in capsys.readouterr().out
    shard = data / "validation-00000.parquet"
    changed = bytearray(shard.read_bytes())
    changed[len(changed) // 2] ^= 0xFF
    shard.write_bytes(bytes(changed))
    assert main(["verify-data", f"file://{data}"]) == 2
    assert f"checksum mismatch for shard {data}/validation-00000.parquet" in capsys.readouterr().err
