"""A shipped dataset reads the same rows as the files, from Ray's object store,
fetching each shard once per node (its decoded copy is the node's)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from raypipe.data import TokenDataset, prepare
from raypipe.data.shipping import ship, shard_bytes


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("shipping") / "tokens", seq_len=16, max_bytes=30_000, rows_per_shard=64)


def test_shipped_rows_equal_the_files_and_need_no_files(ray_cluster, dataset, tmp_path, monkeypatch):
    copy = tmp_path / "tokens"
    shutil.copytree(dataset, copy)
    original = TokenDataset(copy, micro_batch_size=3, num_micro_batches=4)
    assert len(original.shards) > 10
    assert shard_bytes(original) == sum(p.stat().st_size for p in copy.glob("train-*.parquet"))
    expected = {(step, micro_batch): original.get(step, micro_batch) for step in range(6) for micro_batch in range(4)}
    shipped = ship(original)
    shutil.rmtree(copy)  # from here on, the files are gone: only the object store has them
    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "another-node"))  # where no shard was decoded yet
    received = ray_cluster.get(ray_cluster.put(shipped))  # pickled as it travels to a stage
    for (step, micro_batch), want in expected.items():
        for got, wanted in zip(received.get(step, micro_batch), want):
            assert torch.equal(got, wanted)
    assert original.shipped_shards is None and "shipped" in repr(received)

    # A second reader on that node fetches nothing: the shards it needs are decoded there already.
    again = ray_cluster.get(ray_cluster.put(shipped))
    again.shipped_shards = [ray_cluster.put(np.zeros(8, np.uint8))] * len(again.shards)
    for (step, micro_batch), want in expected.items():
        for got, wanted in zip(again.get(step, micro_batch), want):
            assert torch.equal(got, wanted)


def test_a_shipped_shard_is_checked_against_the_manifest(ray_cluster, dataset, tmp_path, monkeypatch):
    original = TokenDataset(dataset, micro_batch_size=3, num_micro_batches=4)
    shipped = ship(original)
    shipped.shipped_shards = list(reversed(shipped.shipped_shards))  # every shard in the wrong place
    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))  # not decoded on this node yet: it is fetched
    with pytest.raises(ValueError, match=r"checksum mismatch for shard .*\(shipped\)"):
        shipped.get(0, 0)
