"""How a tensor crosses a stage boundary.

``object_store`` (default, CPU and GPU): a stage returns its activation or
gradient, Ray stores it and resolves the reference as the next op's argument.
``gloo`` / ``nccl``: Ray Direct Transport over a Ray collective group — the
tensor stays with its producer and is sent point-to-point to the consumer
(NCCL between GPUs; gloo between CPU processes, which lets the same code path be
tested without GPUs). For these the driver submits one task per op and wires
references. ``p2p``: the per-step executor of :mod:`raypipe.comm.p2p` — one task per
stage per step, direct sends between neighbouring stages.
"""
from __future__ import annotations

from typing import Any

import ray

from raypipe.stage.worker import StageWorker


class Transport:
    """Object-store transport; the base of the collective ones."""

    name = "object_store"
    whole_step = False  # True: each stage runs its whole schedule in one task (run_step)

    def actor_class(self) -> Any:
        """The Ray actor class whose F/B outputs travel by this transport."""
        return ray.remote(StageWorker)

    def connect(self, actors: list[Any]) -> None:
        """Prepare the actors for transfers (nothing to do for the object store)."""

    def close(self, actors: list[Any]) -> None:
        """Release what :meth:`connect` set up."""

    def reconnect(self, actors: list[Any]) -> None:
        """Make the transport usable again after a failed step (nothing to do here:
        a failed op leaves nothing behind in the object store)."""


class CollectiveTransport(Transport):
    """Ray Direct Transport over a collective group of the stage actors."""

    def __init__(self, backend: str) -> None:
        self.name = backend
        self._group = None

    def actor_class(self) -> Any:
        return ray.remote(_direct_transport_worker(self.name))

    def connect(self, actors: list[Any]) -> None:
        from ray.experimental.collective import create_collective_group

        self._group = create_collective_group(actors, backend=self.name)

    def close(self, actors: list[Any]) -> None:
        if self._group is None:
            return
        from ray.experimental.collective import destroy_collective_group

        try:
            destroy_collective_group(self._group)
        except Exception:  # noqa: BLE001 - actors may already be gone at shutdown
            pass
        self._group = None


def _direct_transport_worker(backend: str) -> type:
    """A StageWorker whose forward/backward results go by ``backend``."""

    class DirectTransportStageWorker(StageWorker):
        @ray.method(tensor_transport=backend)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

        @ray.method(tensor_transport=backend)
        def backward(self, *args: Any, **kwargs: Any) -> Any:
            return super().backward(*args, **kwargs)

    DirectTransportStageWorker.__name__ = f"StageWorker_{backend}"
    return DirectTransportStageWorker


class P2PTransport(Transport):
    """Stages join a torch.distributed group and run whole steps (see :mod:`raypipe.comm.p2p`)."""

    name = "p2p"
    whole_step = True

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def actor_class(self) -> Any:
        from raypipe.comm.p2p import P2PStageWorker

        return ray.remote(P2PStageWorker)

    def connect(self, actors: list[Any]) -> None:
        address, port = ray.get(actors[0].rendezvous_address.remote())
        ray.get([actor.join_group.remote(address, port, self.timeout_s) for actor in actors])

    def close(self, actors: list[Any]) -> None:
        try:
            ray.get([actor.leave_group.remote() for actor in actors], timeout=30)
        except Exception:  # noqa: BLE001 - actors may already be gone at shutdown
            pass

    def reconnect(self, actors: list[Any]) -> None:
        """A failed step leaves the group broken (its failing stage closed its connections):
        every worker leaves it, and all join a new one under a fresh rendezvous."""
        ray.get([actor.leave_group.remote() for actor in actors])
        self.connect(actors)


def make_transport(name: str, p2p_timeout_s: float = 300.0) -> Transport:
    """The transport called ``name``: "object_store", "gloo", "nccl" or "p2p"."""
    if name == "object_store":
        return Transport()
    if name == "p2p":
        return P2PTransport(p2p_timeout_s)
    if name in ("gloo", "nccl"):
        return CollectiveTransport(name)
    raise ValueError(f"unknown transport {name!r}: expected object_store, gloo, nccl or p2p")
