"""A reader's decoded shards live on its node's disk, memory-mapped: its memory
does not grow with the split, a second reader on the node decodes nothing, and
a damaged, unwritable or narrower copy is handled by name."""
from __future__ import annotations

import gc
import os
import pickle
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from raypipe.data import TokenDataset, prepare
from raypipe.data.access import probe_here
from raypipe.data.decoded import LIMIT_ENV, decoded_dir, open_decoded, writable_problem
from raypipe.errors import DataAccessError
from raypipe.runtime.data_access import datasets_for_readers

ROWS_PER_SHARD = 2048
SEQ_LEN = 255  # rows of 256 tokens: a decoded shard is 2 MB as int32
OPENS_PER_THREAD = 200  # per thread, in the test of opens while garbage is collected


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """29 train shards of the standard library (59 MB decoded as int32)."""
    return prepare(tmp_path_factory.mktemp("decoded") / "tokens", seq_len=SEQ_LEN, max_bytes=16_000_000,
                   rows_per_shard=ROWS_PER_SHARD)


@pytest.fixture
def node_cache(tmp_path, monkeypatch) -> Path:
    """A node where nothing is decoded yet."""
    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "decoded"


RAY_FILES = str(Path(ray.__file__).parent / "*")


def live_bytes() -> int:
    """Bytes this process holds allocated now: numpy's and Python's (traced), and Arrow's pool's. A mapped
    file is not among them (its pages are page cache, which the kernel may drop). Allocators' caches are
    not either: they come and go with the machine, not with what the reader holds. Nor is what Ray's own
    threads allocate meanwhile (any allocation with a frame of Ray's package): in the suite a test before
    this one may have started Ray in this process, and its threads' buffers are not the reader's."""
    traced = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, RAY_FILES, all_frames=True)])
    return sum(trace.size for trace in traced.traces) + pa.total_allocated_bytes()


def shard_of(reader: TokenDataset, step: int) -> int:
    return int(np.searchsorted(reader._offsets, reader.row_indices(step, 0)[0], side="right") - 1)


def read_every_shard(reader: TokenDataset) -> dict[int, np.ndarray]:
    """One row from each shard (single-row steps, in order, until every shard was read): step -> row."""
    rows, seen, step = {}, set(), 0
    while len(seen) < len(reader.shards):
        inputs, targets = reader.get(step, 0)
        rows[step] = np.concatenate([inputs[0].numpy(), targets[0, -1:].numpy()])
        seen.add(shard_of(reader, step))
        step += 1
    return rows


def rows_from_parquet(path: Path, reader: TokenDataset, steps) -> dict[int, np.ndarray]:
    """The same rows read straight from the Parquet files, without raypipe's reader."""
    rows = {}
    for step in steps:
        row = int(reader.row_indices(step, 0)[0])
        shard = shard_of(reader, step)
        table = pq.read_table(path / reader.shards[shard]["file"])
        rows[step] = np.asarray(table.column("tokens")[row - int(reader._offsets[shard])].as_py())
    return rows


def test_a_readers_memory_does_not_grow_with_the_split(dataset, node_cache):
    reader = TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1)
    reader.get(0, 0)  # the epoch's permutation (a row number per row of the split)
    tracemalloc.start(32)  # frames enough to see Ray's in a background thread's allocation
    try:
        before = live_bytes()
        rows = read_every_shard(reader)
        grown = live_bytes() - before
    finally:
        tracemalloc.stop()
    shard_bytes = ROWS_PER_SHARD * (SEQ_LEN + 1) * 4  # one shard decoded as int32 (holding all: 29 of them)
    assert grown < shard_bytes / 2, f"the reader holds {grown / 2**20:.1f} MB more after reading every shard"
    assert len(list(node_cache.glob("*.npy"))) == len(reader.shards)
    expected = rows_from_parquet(dataset, reader, list(rows)[::7])
    assert all(np.array_equal(rows[step], expected[step]) for step in expected)


def test_a_second_reader_on_the_node_decodes_nothing(dataset, node_cache, tmp_path):
    first = TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1)
    rows = read_every_shard(first)
    second = pickle.loads(pickle.dumps(first))  # as a stage gets it; its shards are not mapped yet
    moved = tmp_path / "moved"
    Path(dataset).rename(moved)  # the files are gone: only the node's decoded copies can answer
    try:
        assert all(np.array_equal(read_every_shard(second)[step], row) for step, row in rows.items())
    finally:
        moved.rename(dataset)


def test_a_damaged_decoded_copy_is_decoded_again(dataset, node_cache):
    first = TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1)
    inputs, targets = first.get(0, 0)
    copy = node_cache / f"{first.shards[shard_of(first, 0)]['sha256']}.npy"
    size = copy.stat().st_size
    copy.write_bytes(copy.read_bytes()[:size // 2])  # a disk that lost the end of it
    again = TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1).get(0, 0)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(again, (inputs, targets)))
    assert copy.stat().st_size == size and not list(node_cache.glob("*.partial"))


def test_a_copy_decoded_for_one_vocabulary_is_checked_against_another(dataset, node_cache):
    TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1).get(0, 0)  # decoded, within 259 ids
    small = TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1, vocab_size=100)
    with pytest.raises(ValueError, match=r"train-\d+\.parquet row \d+ holds token id \d+, outside the vocabulary "
                                         r"\[0, 100\)"):
        small.get(0, 0)


def test_copies_hold_the_narrowest_type_that_fits(node_cache):
    small = np.array([[0, 1, 65535]], dtype=np.int32)
    large = np.array([[0, 70_000, 3]], dtype=np.int32)
    for name, tokens, kind in (("a" * 64, small, np.uint16), ("b" * 64, large, np.int32)):
        mapped = open_decoded(name, 3, lambda tokens=tokens: tokens, "shard.parquet")
        assert mapped.dtype == kind and np.array_equal(mapped, tokens) and isinstance(mapped, np.memmap)


def shard(value: int) -> np.ndarray:
    """100 rows of 64 token ids, each ``value``."""
    return np.full((100, 64), value, dtype=np.int32)


def test_under_a_limit_a_new_copy_removes_the_copies_opened_longest_ago(node_cache, monkeypatch):
    a, b, c, d = (letter * 64 for letter in "abcd")
    held = {name: open_decoded(name, 64, lambda value=value: shard(value), f"shard-{value}")
            for value, name in enumerate((a, b, c))}
    now = time.time()
    for name, age in ((a, 30), (b, 20), (c, 10)):
        os.utime(node_cache / f"{name}.npy", (now - age, now - age))
    open_decoded(a, 64, lambda: pytest.fail("decoded again"), "shard-0")  # opened again: now the newest
    size = (node_cache / f"{a}.npy").stat().st_size
    monkeypatch.setenv(LIMIT_ENV, f"{2 * size + size // 2}B")  # room for two copies
    open_decoded(d, 64, lambda: shard(3), "shard-3")
    assert sorted(path.stem[0] for path in node_cache.glob("*.npy")) == ["a", "d"]
    assert np.array_equal(held[b], shard(1))  # a reader that has a removed copy open still reads it
    decoded = []
    again = open_decoded(b, 64, lambda: decoded.append(b) or shard(1), "shard-1")  # a later opener decodes it
    assert decoded == [b] and np.array_equal(again, shard(1))
    assert sorted(path.stem[0] for path in node_cache.glob("*.npy")) == ["b", "d"]  # a went: opened before d


def test_readers_under_a_limit_smaller_than_the_split_read_every_row(dataset, node_cache, monkeypatch):
    unlimited = read_every_shard(TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1))
    largest = max(path.stat().st_size for path in node_cache.glob("*.npy"))
    for path in node_cache.glob("*.npy"):
        path.unlink()
    monkeypatch.setenv(LIMIT_ENV, f"{3 * largest}B")  # 3 of the split's 29 shards
    limited = read_every_shard(TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1))
    assert limited.keys() == unlimited.keys()
    assert all(np.array_equal(limited[step], row) for step, row in unlimited.items())
    assert sum(path.stat().st_size for path in node_cache.glob("*.npy")) <= 3 * largest


def test_partial_copies_a_dead_writer_left_are_removed_and_a_live_writers_are_not(node_cache):
    node_cache.mkdir(parents=True)
    stale, live = node_cache / f".{'f' * 64}-x1.partial", node_cache / f".{'f' * 64}-x2.partial"
    for partial in (stale, live):
        partial.write_bytes(b"half a copy")
    stuck = node_cache / f".{'f' * 64}-x3.partial"  # a leftover that cannot be unlinked
    stuck.mkdir()
    (stuck / "inside").write_bytes(b"")
    two_hours_ago = time.time() - 7200
    for partial in (stale, stuck):
        os.utime(partial, (two_hours_ago, two_hours_ago))
    mapped = open_decoded("g" * 64, 64, lambda: shard(5), "shard-5")  # the process's first write there sweeps
    assert not stale.exists() and live.exists() and stuck.exists()
    assert np.array_equal(mapped, shard(5))  # the leftover it could not remove did not fail the write


def test_a_limit_that_is_not_a_size_is_an_error_naming_it(node_cache, monkeypatch):
    monkeypatch.setenv(LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match=r"RAYPIPE_DECODED_LIMIT: invalid size 'lots': expected a number and a unit"):
        open_decoded("e" * 64, 64, lambda: pytest.fail("decoded before the setting was checked"), "shard-4")


def test_an_unwritable_cache_names_itself_and_the_setting(dataset, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("RAYPIPE_CACHE", str(blocker / "cache"))
    assert str(blocker / "cache" / "decoded") in writable_problem()
    reader = TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1)
    with pytest.raises(OSError, match=r"cannot write the decoded copy of shard .*train-\d+\.parquet to "
                                      r".*a-file/cache/decoded/.*set RAYPIPE_CACHE to a writable local directory"):
        reader.get(0, 0)
    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))
    assert writable_problem() is None and decoded_dir() == tmp_path / "cache" / "decoded"


@ray.remote(num_cpus=0)
class Reader:
    """A process that answers the probe the stage workers answer before step 0."""

    def probe_data(self, uris: list[str]) -> dict:
        return probe_here(uris)


def test_a_worker_that_cannot_keep_decoded_shards_stops_the_run_before_step_0(ray_cluster, dataset, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    reader = Reader.options(runtime_env={"env_vars": {"RAYPIPE_CACHE": str(blocker)}}).remote()
    train = TokenDataset(dataset, micro_batch_size=1, num_micro_batches=1)
    with pytest.raises(DataAccessError, match=r"replica 0, stage 1 on node \w+ \(.*\) cannot write decoded shards to "
                                              r".*a-file/decoded .*set RAYPIPE_CACHE to a writable local directory"):
        datasets_for_readers([(0, 1, reader)], [train], ray.get)
    ray.kill(reader)


class _CollectedWithAFinalizer:
    """Cyclic garbage whose finalizer lets other threads run while the collector runs."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        time.sleep(0)


def test_threads_opening_copies_while_garbage_is_collected_all_get_them(node_cache):
    """A stage's read-ahead thread and its step open shards at once. With garbage collected inside
    np.load's header parse, unserialized opens failed one of them (SystemError: AST constructor
    recursion depth mismatch) in each of 5 runs of this test (3 of them with
    these 200 opens a thread), and with the garbage paced in each of 25; in CI it failed a data-reader
    test once."""
    open_decoded("a" * 64, 17, lambda: np.zeros((4, 17), np.int64), "shard-0")
    thresholds = gc.get_threshold()
    failures, stop = [], threading.Event()

    def make_garbage():
        # paced: a collection inside a parse needs one finalizer to let the others run, not hundreds (each
        # sleep(0) takes ~60 us: unpaced, the finalizers made the 600 opens take ~10 s, not ~1.3)
        while not stop.is_set():
            _CollectedWithAFinalizer()
            time.sleep(0.001)

    def open_many():
        try:
            for _ in range(OPENS_PER_THREAD):
                assert open_decoded("a" * 64, 17, lambda: pytest.fail("decoded again"), "shard-0").shape == (4, 17)
        except BaseException as error:  # noqa: BLE001 - reported below, with its thread's kind
            failures.append(error)

    gc.set_threshold(50)  # collections often, some inside a parse
    threads = [threading.Thread(target=make_garbage)] + [threading.Thread(target=open_many) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads[1:]:
            thread.join()
    finally:
        stop.set()
        threads[0].join()
        gc.set_threshold(*thresholds)
    assert failures == []
