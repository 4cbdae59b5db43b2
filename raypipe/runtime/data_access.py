"""Before step 0: every worker that reads data opens the dataset where it runs
(one parallel round of small calls); each gets the dataset itself, or a shipped
copy of a local one it cannot open, or the run stops with a DataAccessError."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from raypipe.data.access import READ, Probe, Where, check_decoded_cache, check_ship_size, manifest_digest, read_or_ship
from raypipe.data.shipping import ship, shard_bytes
from raypipe.errors import DataAccessError

logger = logging.getLogger(__name__)

DEFAULT_SHIP_DATA_LIMIT_BYTES = 1 << 30


def datasets_for_readers(readers: Sequence[tuple[int, int, Any]], datasets: Sequence[Any],
                         get: Callable[[list], list], limit: int = DEFAULT_SHIP_DATA_LIMIT_BYTES,
                         shipped: dict[int, Any] | None = None) -> list[list[Any]]:
    """Each reader's own list of ``datasets``, in the order of ``readers`` ((replica, stage, actor)).

    Datasets without a ``uri`` (not file-backed) and None pass through as they are.
    A local dataset that some reader cannot open is shipped once (see
    :func:`raypipe.data.shipping.ship`), if the shards of all datasets shipped
    come to at most ``limit`` bytes. ``shipped`` keeps the shipped copies (by
    ``id`` of the original) across calls, so a replaced reader gets the same ones.
    """
    uris = sorted({d.uri for d in datasets if getattr(d, "uri", None) is not None})
    if not uris:
        return [list(datasets) for _ in readers]
    driver = _driver_digests(uris)
    reports = get([actor.probe_data.remote(uris) for _, _, actor in readers])
    cannot_open: list[set[str]] = []  # per reader: the local paths it cannot open (any other problem raised)
    for (replica, stage, _), report in zip(readers, reports):
        where = Where(replica, stage, report["node_id"], report["node_ip"])
        check_decoded_cache(uris, where, report["decoded_problem"])
        probes = {uri: Probe(**report["probes"][uri]) for uri in uris}
        cannot_open.append({uri for uri in uris if read_or_ship(uri, driver[uri], probes[uri], where) != READ})
        for uri in sorted(cannot_open[-1]):
            check_ship_size(uri, where, probes[uri].error, _shipped_size(datasets, cannot_open), limit)
            logger.warning("dataset %s: %s cannot open it; shipping its shards through Ray's object store", uri, where)
    shipped = {} if shipped is None else shipped
    for dataset in datasets:
        if getattr(dataset, "uri", None) in set().union(*cannot_open) and id(dataset) not in shipped:
            shipped[id(dataset)] = ship(dataset)
    return [[shipped[id(d)] if getattr(d, "uri", None) in unopened else d for d in datasets]
            for unopened in cannot_open]


def _shipped_size(datasets: Sequence[Any], cannot_open: list[set[str]]) -> int:
    """Bytes of every dataset shipped so far (the check grows as readers are found that need more)."""
    needed = set().union(*cannot_open)
    return sum(shard_bytes(d) for d in datasets if getattr(d, "uri", None) in needed)


def _driver_digests(uris: list[str]) -> dict[str, str]:
    digests = {}
    for uri in uris:
        try:
            digests[uri] = manifest_digest(uri)
        except Exception as error:  # noqa: BLE001 - the driver must read what it hands out
            raise DataAccessError(uri, "the driver", f"cannot open it ({type(error).__name__}: {error})",
                                  "Check the path") from None
    return digests
