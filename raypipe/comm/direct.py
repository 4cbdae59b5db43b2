"""Ray Direct Transport over a Ray collective group: an op's tensor result stays
with its producer and is sent point-to-point to the consumer (NCCL between GPUs;
gloo between CPU processes, which runs the same code path without GPUs)."""
from __future__ import annotations

from typing import Any

import ray

from raypipe.comm.object_store import ObjectStoreTransport
from raypipe.runtime.health import worker_actor_class


class DirectTransport(ObjectStoreTransport):
    """Forward and backward results go by ``backend`` ("nccl" or "gloo"); every other
    result (grad stats, reports) stays a plain object that other tasks may depend on."""

    def __init__(self, backend: str) -> None:
        self.name = backend
        self._group = None

    def actor_class(self, worker_class: type) -> Any:
        return worker_actor_class(direct_transport_worker(worker_class, self.name))

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


def direct_transport_worker(worker_class: type, backend: str) -> type:
    """``worker_class`` whose forward/backward results go by ``backend``."""

    class DirectTransportWorker(worker_class):
        @ray.method(tensor_transport=backend)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

        @ray.method(tensor_transport=backend)
        def backward(self, *args: Any, **kwargs: Any) -> Any:
            return super().backward(*args, **kwargs)

    DirectTransportWorker.__name__ = f"{worker_class.__name__}_{backend}"
    return DirectTransportWorker
