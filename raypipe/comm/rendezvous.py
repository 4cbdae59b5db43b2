"""Where a run's process group meets: the store its ranks rendezvous through, listening on the
node of its first worker.

The store is opened here, on a port the kernel gives it, and held until that worker joins: a
port chosen free and bound later (what ``init_method="tcp://…"`` does) can be taken by any
process on the node in between, and then the group's first rank fails with EADDRINUSE."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


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
