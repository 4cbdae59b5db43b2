"""Where a stage worker class becomes a Ray actor class: its threads (concurrency
groups) declared, and for Ray Direct Transport the methods whose results go by the
collective backend. The executors name the worker class and the transport; only
this module calls ``ray.remote`` on a worker class (and freezes each worker process's heap
once the worker is built: :func:`frozen_heap_worker`)."""
from __future__ import annotations

import gc
import weakref
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
    return ray.remote(concurrency_groups=WORKER_CONCURRENCY_GROUPS)(frozen_heap_worker(worker_class))


def frozen_heap_worker(worker_class: type) -> type:
    """``worker_class`` whose process, once the worker is built, puts every object it holds then
    out of reach of the cyclic garbage collector (``gc.freeze``): the modules imported (torch's,
    Ray's: ~200k objects), the stage's layers and optimizer. Left in, each of the collector's full
    passes walks them all, 0.1-0.2 s, at a step the allocations choose, and stops that worker and the
    pipeline behind it there (timed layers, interleaved 1F1B, p = 4, m = 8: two steps of ~460 and
    ~630 ms among steps of ~255, the same two steps in every run). What is made later is collected
    as before, and a frozen object is still freed once nothing refers to it (the stage's layers
    and optimizer, dropped when a layout change builds the model afresh, hold no reference cycle);
    a cycle among frozen objects is found only by a full pass over them, which runs where a layout
    change built the model afresh (a user's layer may make one). Megatron-LM (``--manual-gc``) and
    torchtitan (``gc_freq``) take the same passes off the step's path by collecting between steps
    themselves. Only the workers' processes: the driver's heap is the user's."""

    class FrozenHeapWorker(worker_class):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            gc.freeze()  # no full pass first: ~0.1 s of a worker's start, for ~30 objects of garbage

        def take_layout(self, spec: Any) -> None:
            # a weak reference: the worker frees its old model before it builds the new one (one model in
            # memory at a time), which a reference held here would prevent
            built = weakref.ref(self.layers) if hasattr(self, "layers") else None
            super().take_layout(spec)
            if built is not None and built() is not self.layers:
                _frozen_after_a_full_pass()

    FrozenHeapWorker.__name__, FrozenHeapWorker.__qualname__ = worker_class.__name__, worker_class.__qualname__
    FrozenHeapWorker.__doc__ = worker_class.__doc__
    return FrozenHeapWorker


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


def _frozen_after_a_full_pass() -> None:
    """Collect every unreachable object, frozen ones included, then freeze what remains."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
