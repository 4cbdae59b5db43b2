"""The rule that turns a reading worker's probe into: read it there, ship it, or stop."""
from __future__ import annotations

import pytest

from raypipe.data import prepare
from raypipe.data.access import READ, SHIP, Probe, Where, check_ship_size, manifest_digest, probe, read_or_ship
from raypipe.errors import DataAccessError

WHERE = Where(replica=1, stage=3, node_id="abc123", node_ip="10.0.0.7")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return str(prepare(tmp_path_factory.mktemp("access") / "tokens", seq_len=16, max_bytes=5_000))


def test_probe_reads_the_manifest_or_says_why_not(dataset, tmp_path):
    found = probe(dataset)
    assert found.error is None and found.digest == manifest_digest(dataset) and len(found.digest) == 64
    missing = probe(str(tmp_path / "nowhere"))
    assert missing.digest is None and "manifest.json" in missing.error


def test_the_same_manifest_is_read_directly_anywhere(dataset):
    digest = manifest_digest(dataset)
    assert read_or_ship(dataset, digest, Probe(digest, None), WHERE) == READ
    assert read_or_ship("s3://bucket/tokens", digest, Probe(digest, None), WHERE) == READ


def test_a_local_path_the_worker_cannot_open_is_shipped(dataset):
    assert read_or_ship(dataset, "d" * 64, Probe(None, "FileNotFoundError: ..."), WHERE) == SHIP
    assert read_or_ship("file:///data/tokens", "d" * 64, Probe(None, "FileNotFoundError: ..."), WHERE) == SHIP


def test_a_uri_the_worker_cannot_open_names_path_worker_and_node():
    with pytest.raises(DataAccessError) as caught:
        read_or_ship("s3://bucket/tokens", "d" * 64, Probe(None, "OSError: AWS Error ACCESS_DENIED"), WHERE)
    message = str(caught.value)
    assert message.startswith("dataset s3://bucket/tokens: replica 1, stage 3 on node abc123 (10.0.0.7) cannot open")
    assert "ACCESS_DENIED" in message and "credentials" in message
    assert caught.value.path == "s3://bucket/tokens" and caught.value.where == WHERE


def test_another_dataset_at_the_same_path_is_an_error():
    with pytest.raises(DataAccessError, match="reads a different dataset there than the driver"):
        read_or_ship("/data/tokens", "d" * 64, Probe("e" * 64, None), WHERE)


def test_shipping_above_the_limit_points_to_shared_storage():
    check_ship_size("/data/tokens", WHERE, "FileNotFoundError: x", size=1000, limit=1000)
    with pytest.raises(DataAccessError) as caught:
        check_ship_size("/data/tokens", WHERE, "FileNotFoundError: x", size=1001, limit=1000)
    message = str(caught.value)
    assert "1,001 bytes, above ship_data_limit_bytes=1,000" in message
    assert "s3:// or gs://" in message and "shared filesystem" in message and "raise ship_data_limit_bytes" in message
