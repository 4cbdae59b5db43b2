"""A worker actor's process freezes its heap once the worker is built (gc.freeze), so the
collector's full passes do not walk the imported modules mid-step; a layout change that builds
the model afresh runs one full pass first, so a reference cycle in the old model is not kept, and holds
no reference to the old model while the worker builds the new one (one model in memory at a time)."""
import gc
import weakref

from raypipe.runtime.actor_classes import frozen_heap_worker


class Cycle:
    """A layer that refers to itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


class Worker:
    """A worker's shape as the wrapper sees it: layers built in __init__, rebuilt by some layouts."""

    def __init__(self) -> None:
        self.layers = Cycle()

    def take_layout(self, spec: str) -> None:
        if spec == "rebuilt":
            self.layers = Cycle()


def test_a_built_worker_freezes_its_heap_and_a_rebuilt_models_cycle_is_collected_at_once():
    frozen = frozen_heap_worker(Worker)
    assert (frozen.__name__, frozen.__qualname__) == ("Worker", "Worker")  # Ray names the actor by it
    gc.unfreeze()
    try:
        worker = frozen()
        assert gc.get_freeze_count() > 0
        first = weakref.ref(worker.layers)
        worker.take_layout("kept")
        assert first() is worker.layers
        worker.take_layout("rebuilt")
        assert first() is None  # frozen, the old cycle would outlive any automatic collection
        assert gc.get_freeze_count() > 0
        second = weakref.ref(worker.layers)
        del worker
        gc.collect()
        assert second() is not None  # frozen: kept, cycle and all (built with the worker, a process's life)
    finally:
        gc.unfreeze()
        gc.collect()


class Layer:
    """A layer without a reference cycle: freed as soon as nothing refers to it."""


class FreeingWorker:
    """Frees its old model before it builds the new one, as StageWorker.take_layout does, and notes
    whether the old one was still alive as the new one was built."""

    def __init__(self) -> None:
        self.layers = Layer()

    def take_layout(self, spec: str) -> None:
        old = weakref.ref(self.layers)
        del self.layers
        self.old_alive_while_building = old() is not None
        self.layers = Layer()


def test_a_rebuilt_model_is_built_once_the_old_one_is_freed():
    worker = frozen_heap_worker(FreeingWorker)()
    try:
        worker.take_layout("rebuilt")
        assert worker.old_alive_while_building is False
    finally:
        gc.unfreeze()
        gc.collect()
