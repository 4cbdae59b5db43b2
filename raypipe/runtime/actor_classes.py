"""Where a stage worker class becomes a Ray actor class: its threads (concurrency
groups) declared, and for Ray Direct Transport the methods whose results go by the
collective backend. The executors name the worker class and the transport; only
this module calls ``ray.remote`` on a worker class."""
from __future__ import annotations

from typing import Any

import ray

from raypipe.stage.concurrency_groups import WORKER_CONCURRENCY_GROUPS


def worker_actor_class(worker_class: type, tensor_transport: str | None = None) -> Any:
    """``worker_class`` as a Ray actor class whose heartbeats run on their own thread,
    and its waits for background checkpoint writes on another; its other methods run
    one at a time, in submission order. ``tensor_transport`` ("nccl" or "gloo"): its
    forward and backward results go by Ray Direct Transport over that backend
    (:func:`direct_transport_worker`); None: through the object store."""
    if tensor_transport is not None:
        worker_class = direct_transport_worker(worker_class, tensor_transport)
    return ray.remote(concurrency_groups=WORKER_CONCURRENCY_GROUPS)(worker_class)


def direct_transport_worker(worker_class: type, backend: str) -> type:
    """``worker_class`` whose forward/backward (and input-gradient) results go by ``backend``. Only those:
    every other result (grad stats, reports) stays a plain object that other tasks
    may depend on. A result that is a tree of tensors (:mod:`raypipe.stage.boundary`) goes
    too: Ray takes every tensor out of the value as it serializes it and sends each by the
    backend, the rest with the reference; its tensors must share one device type, which the
    worker's forward checks of every leaf (the stage's device)."""

    class DirectTransportWorker(worker_class):
        @ray.method(tensor_transport=backend)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

        @ray.method(tensor_transport=backend)
        def backward(self, *args: Any, **kwargs: Any) -> Any:
            return super().backward(*args, **kwargs)

        @ray.method(tensor_transport=backend)
        def backward_input(self, *args: Any, **kwargs: Any) -> Any:  # a split backward's I: B's result
            return super().backward_input(*args, **kwargs)

    DirectTransportWorker.__name__ = f"{worker_class.__name__}_{backend}"
    return DirectTransportWorker
