"""A shipped dataset reads the same rows as the files, from Ray's object store,
holding only a few decoded shards."""
from __future__ import annotations

import shutil

import pytest
import torch

from raypipe.data import TokenDataset, prepare
from raypipe.data.dataset import SHIPPED_SHARDS_HELD
from raypipe.data.shipping import ship, shard_bytes


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("shipping") / "tokens", seq_len=16, max_bytes=30_000, rows_per_shard=64)


def test_shipped_rows_equal_the_files_and_need_no_files(ray_cluster, dataset, tmp_path):
    copy = tmp_path / "tokens"
    shutil.copytree(dataset, copy)
    original = TokenDataset(copy, micro_batch_size=3, num_micro_batches=4)
    assert len(original.shards) > 10
    assert shard_bytes(original) == sum(p.stat().st_size for p in copy.glob("train-*.parquet"))
    shipped = ship(original)
    shutil.rmtree(copy)  # from here on, the files are gone: only the object store has them
    received = ray_cluster.get(ray_cluster.put(shipped))  # pickled as it travels to a stage
    for step in range(6):
        for micro_batch in range(4):
            expected = TokenDataset(dataset, micro_batch_size=3, num_micro_batches=4).get(step, micro_batch)
            for got, want in zip(received.get(step, micro_batch), expected):
                assert torch.equal(got, want)
            assert len(received._loaded) <= SHIPPED_SHARDS_HELD
    assert original.shipped_shards is None and "shipped" in repr(received)


def test_a_shipped_shard_is_checked_against_the_manifest(ray_cluster, dataset):
    original = TokenDataset(dataset, micro_batch_size=3, num_micro_batches=4)
    shipped = ship(original)
    shipped.shipped_shards = list(reversed(shipped.shipped_shards))  # every shard in the wrong place
    with pytest.raises(ValueError, match=r"checksum mismatch for shard .*\(shipped\)"):
        shipped.get(0, 0)
