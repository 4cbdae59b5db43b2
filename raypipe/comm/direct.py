"""Ray Direct Transport over a Ray collective group: an op's tensor result stays
with its producer and is sent point-to-point to the consumer (NCCL between GPUs;
gloo between CPU processes, which runs the same code path without GPUs)."""
from __future__ import annotations

from typing import Any

from raypipe.comm.object_store import ObjectStoreTransport


class DirectTransport(ObjectStoreTransport):
    """Forward and backward results go by ``backend`` ("nccl" or "gloo"); every other
    result (grad stats, reports) stays a plain object that other tasks may depend on
    (the workers' actor class: :func:`raypipe.runtime.actor_classes.worker_actor_class`)."""

    def __init__(self, backend: str) -> None:
        self.name = self.tensor_transport = backend
        self._group = None

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

