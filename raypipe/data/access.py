"""Can a worker read the dataset where it runs? The probe each reading worker
runs, and the rule that turns its answer into: read it there, ship it, or stop."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from raypipe.data.cache import CACHE_ENV
from raypipe.data.shards import MANIFEST
from raypipe.errors import DataAccessError
from raypipe.filesystem import filesystem_for

READ, SHIP = "read", "ship"
SHARED_STORAGE = ("s3:// or gs:// (with credentials on every node), or a shared filesystem mounted at the same "
                  "path on every node")
SHARED_STORAGE_ADVICE = f"Put the dataset where every node reads the same files: {SHARED_STORAGE}"


@dataclass(frozen=True)
class Probe:
    """What one worker found at a dataset path: the manifest's sha256, or why it could not read it."""

    digest: str | None
    error: str | None


@dataclass(frozen=True)
class Where:
    """A reading worker and its node, as errors name them."""

    replica: int
    stage: int
    node_id: str
    node_ip: str

    def __str__(self) -> str:
        return f"replica {self.replica}, stage {self.stage} on node {self.node_id} ({self.node_ip})"


def manifest_digest(uri: str) -> str:
    """sha256 of the dataset's manifest bytes at ``uri``; raises OSError if it cannot be read."""
    filesystem, root = filesystem_for(uri)
    with filesystem.open_input_stream(f"{root}/{MANIFEST}") as stream:
        return hashlib.sha256(stream.read()).hexdigest()


def probe(uri: str) -> Probe:
    """Open the manifest at ``uri`` from this process; never raises."""
    try:
        return Probe(manifest_digest(uri), None)
    except Exception as error:  # noqa: BLE001 - any failure to read is the answer, reported by the driver
        return Probe(None, f"{type(error).__name__}: {error}")


def probe_here(uris: list[str]) -> dict:
    """What a reading worker reports before step 0: its node, what it finds at each
    dataset path, and why it could not keep decoded shards on its disk (or None)."""
    import ray

    from raypipe.data.decoded import writable_problem

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "probes": {uri: vars(probe(uri)) for uri in uris}, "decoded_problem": writable_problem()}


def check_decoded_cache(uris: list[str], where: Where, problem: str | None) -> None:
    """Refuse a reader that cannot write decoded shards where it runs (``problem`` from :func:`probe_here`)."""
    if problem is not None:
        raise DataAccessError(", ".join(uris), where, problem,
                              f"Readers keep each decoded shard on their node's disk (about 2 bytes per token): set "
                              f"{CACHE_ENV} to a writable local directory with room for the dataset in the workers' "
                              "environment")


def is_local(uri: str) -> bool:
    """A path on the driver's own disks (which other nodes may not have), not object storage."""
    return "://" not in uri or uri.startswith("file://")


def read_or_ship(uri: str, driver_digest: str, found: Probe, where: Where) -> str:
    """How the worker at ``where`` gets the dataset: READ (it reads the driver's dataset itself) or
    SHIP (a local dataset it cannot open); anything else is a :class:`DataAccessError`.

    Shipping is decided by what the worker can open, not by which node it is on:
    a worker on another node that sees the same files (a shared filesystem)
    reads them itself, and one that sees other files at the same path is an error.
    """
    if found.digest == driver_digest:
        return READ
    if found.digest is not None:
        raise DataAccessError(uri, where, f"reads a different dataset there than the driver (manifest sha256 "
                                          f"{found.digest[:12]}..., the driver's {driver_digest[:12]}...)",
                              SHARED_STORAGE_ADVICE)
    if is_local(uri):
        return SHIP
    raise DataAccessError(uri, where, f"cannot open its {MANIFEST} there ({found.error})",
                          f"Give every node access to it (credentials, network), or use {SHARED_STORAGE}")


def check_ship_size(uri: str, where: Where, error: str, size: int, limit: int) -> None:
    """Refuse to ship more than ``limit`` bytes through the object store."""
    if size > limit:
        raise DataAccessError(uri, where, f"cannot open it there ({error}): it is on the driver's disk only, and "
                                          f"shipping the run's shards through Ray's object store takes {size:,} "
                                          f"bytes, above ship_data_limit_bytes={limit:,}",
                              SHARED_STORAGE_ADVICE + ", or raise ship_data_limit_bytes")
