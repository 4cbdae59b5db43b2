"""Where a run's process group meets: the store its ranks rendezvous through, listening on the
node of its first worker.

The store is opened here, on a port the kernel gives it, and held until that worker joins: a
port chosen free and bound later (what ``init_method="tcp://…"`` does) can be taken by any
process on the node in between, and then the group's first rank fails with EADDRINUSE.

Every rank then waits at the store until all have arrived (:func:`wait_for_every_rank`) before
any builds the process group: that wait can be abandoned (a peer was found lost before it
joined: the driver says so), where the process group's own rendezvous would hold every rank
that came until ``p2p_timeout_s`` passed."""
from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from raypipe.errors import RaypipeError

_ARRIVED = "raypipe/arrived"  # beside the process group's own keys, which torch prefixes


class Rendezvous:
    """The group's store, opened on rank 0's node and listening before any rank joins.

    ``address``/``port`` are what the other ranks connect to; :meth:`take_store` hands the open
    store to rank 0's join (once: a later group meets at a new one)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        # no world size: opening must not wait for the other ranks, which learn the port from us
        self._store: dist.TCPStore | None = dist.TCPStore(address, 0, None, True, timedelta(seconds=timeout_s),
                                                          wait_for_workers=False)
        self.address, self.port = address, self._store.port

    def take_store(self) -> dist.TCPStore:
        """The open store, for rank 0's join; it belongs to that group from then on."""
        if self._store is None:
            raise RuntimeError("this rendezvous's store was already taken: each group meets at a new one")
        store, self._store = self._store, None
        return store


def open_rendezvous(timeout_s: float) -> Rendezvous:
    """A rendezvous on this Ray node (its address as the cluster knows it)."""
    import ray

    return Rendezvous(ray.util.get_node_ip_address(), timeout_s)


def group_store(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The store of the group at ``address:port`` as rank ``rank`` reaches it: rank 0 opens it
    there (a caller that chose the port itself), every other rank connects to it."""
    return dist.TCPStore(address, port, world_size, rank == 0, timedelta(seconds=timeout_s), wait_for_workers=False)


def wait_for_every_rank(store: dist.Store, world_size: int, timeout_s: float, abandoned: Callable[[], bool]) -> None:
    """Count this rank in at the group's store and return once all ``world_size`` have come.
    Raises :class:`~raypipe.errors.RaypipeError` as soon as ``abandoned()`` (polled here, set from
    another thread), or after ``timeout_s``, saying how many came."""
    arrived, deadline, pause_s = store.add(_ARRIVED, 1), time.monotonic() + timeout_s, 0.002
    while arrived < world_size:
        if abandoned():
            raise RaypipeError(f"joining the group was abandoned with {arrived} of its {world_size} ranks arrived "
                               "(a peer was found lost before it joined)")
        if time.monotonic() > deadline:
            raise RaypipeError(f"only {arrived} of the group's {world_size} ranks arrived at its rendezvous "
                               f"within p2p_timeout_s={timeout_s:g}s")
        time.sleep(pause_s)
        pause_s = min(0.1, pause_s * 2)  # quick when the ranks arrive together; light on a large group's store
        arrived = store.add(_ARRIVED, 0)
