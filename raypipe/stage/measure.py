"""Measure what a stage holds for backward: tensors saved by autograd."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class SavedTensorMeter:
    """Counts the bytes of unique storages autograd saves inside the context.

    Parameters (and the storages they live in) are excluded: they are static
    memory, counted by the memory model apart from activations. Storages are
    counted once however many views of them are saved.
    """

    def __init__(self, parameter_storages: set[int], counted: tuple[torch.Tensor, ...] = ()) -> None:
        # parameters are static memory (see storage_pointers); ``counted`` tensors are
        # already accounted for elsewhere
        self._parameter_storages = parameter_storages | storage_pointers(counted)
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        # detached (the same storage and version counter, no grad_fn): a saved output kept as itself
        # would hold its own node, a cycle through autograd's C++ graph that the garbage collector
        # never frees; a whole backward releases saved tensors and so breaks it, but a split backward
        # retains the graph (I, then W), and every step's graphs stayed (~125 MB a step, tiny LLaMA)
        return tensor.detach()

    def add(self, *tensors: torch.Tensor) -> None:
        """Count tensors the stage keeps by other means (e.g. its graph's outputs)."""
        for storage in (storage for tensor in tensors for storage in _storages(tensor)):
            pointer = storage.data_ptr()
            if pointer not in self._seen and pointer not in self._parameter_storages:
                self._seen.add(pointer)
                self.bytes += storage.nbytes()

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def storage_pointers(tensors) -> set[int]:
    """The storages ``tensors`` live in (parameters: computed once per stage)."""
    return {storage.data_ptr() for t in tensors for storage in _storages(t)}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages ``tensors`` live in."""
    storages = {storage.data_ptr(): storage for t in tensors for storage in _storages(t)}
    return sum(storage.nbytes() for storage in storages.values())


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages ``tensor``'s data lives in: a wrapper subclass's (a DTensor, an
    AsyncCollectiveTensor) are its inner tensors', it has none of its own."""
    if is_traceable_wrapper_subclass(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # not a DTensor's mesh
                yield from _storages(inner)
    else:
        yield tensor.untyped_storage()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def rss_bytes() -> int:
    """Resident set size of this process now."""
    import psutil

    return psutil.Process().memory_info().rss


def device_memory_bytes(device: torch.device) -> dict[str, int | None]:
    """CUDA memory of ``device`` now, by :class:`~raypipe.core.result.StageStats` field:
    allocated (live tensors), peak allocated since the step's reset, and reserved (what
    the caching allocator holds from the driver: allocated plus its cache, the figure an
    out-of-memory compares against the card). None for each on a CPU device."""
    if device.type != "cuda":
        return {"device_allocated_bytes": None, "device_peak_bytes": None, "device_reserved_bytes": None}
    return {"device_allocated_bytes": torch.cuda.memory_allocated(device),
            "device_peak_bytes": torch.cuda.max_memory_allocated(device),
            "device_reserved_bytes": torch.cuda.memory_reserved(device)}
