"""Measure what a stage holds for backward: tensors saved by autograd."""
from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # statm counts pages


class SavedTensorMeter:
    """Counts the bytes of unique storages autograd saves inside the context.

    Parameters (and the storages they live in) are excluded: they are static
    memory, counted by the memory model apart from activations. Storages are
    counted once however many views of them are saved.
    """

    def __init__(self, parameter_storages: set[int], counted: tuple[torch.Tensor, ...] = (),
                 record: Callable[[int], None] | None = None) -> None:
        # parameters are static memory (see storage_pointers); ``counted`` tensors are
        # already accounted for elsewhere; ``record(bytes)`` once the context ends without an error
        self._parameter_storages = parameter_storages | storage_pointers(counted) if counted else parameter_storages
        self._record = record
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
        if self._record is not None and exc[0] is None:
            self._record(self.bytes)


# a step's forwards are metered every this many steps (the first one included); the steps between
# recall what the same micro-batch saved last time it was metered
SAVED_BYTES_EVERY = 100


class SavedBytes:
    """What each micro-batch's forward saves for backward, metered by a :class:`SavedTensorMeter`
    on a stage's first step and every :data:`SAVED_BYTES_EVERY`-th after it, and recalled on the
    steps between (a hook on every saved tensor costs microseconds each, every micro-batch).

    A figure is recalled only for the same forward (``key``: e.g. its chunk, micro-batch and
    whether it is a recompute) on tensors of the same shapes, dtypes and devices as when it was
    metered; a new shape is metered at once. So the figure is exact for a model whose saved
    tensors follow from its inputs' shapes, and at most ``SAVED_BYTES_EVERY - 1`` steps old
    for one whose saved sizes depend on the data's values (e.g. a data-dependent mask or routing).
    """

    def __init__(self, parameter_storages: set[int], every: int | None = None) -> None:
        self._parameter_storages = parameter_storages
        self._every = every or SAVED_BYTES_EVERY
        self._steps = 0  # steps begun
        self._recorded: dict[Hashable, tuple[tuple, int]] = {}  # key: (signature, bytes) when metered

    def new_step(self) -> None:
        """A step begins: on the first and every ``every``-th (default :data:`SAVED_BYTES_EVERY`), each
        forward is metered again."""
        if self._steps % self._every == 0:
            self._recorded.clear()
        self._steps += 1

    def meter(self, key: Hashable, tensors: Sequence[torch.Tensor],
              counted: tuple[torch.Tensor, ...] = ()) -> SavedTensorMeter | RecalledBytes:
        """The context to run forward ``key`` in, on ``tensors`` (its inputs and targets): a
        :class:`SavedTensorMeter` that records what it counts, or the bytes recalled for it."""
        # a view's storage may be larger than the view (a micro-batch split from its batch): counted whole
        signature = tuple((t.shape, t.dtype, t.device, tuple(s.nbytes() for s in _storages(t))) for t in tensors)
        recorded = self._recorded.get(key)
        if recorded is not None and recorded[0] == signature:
            return RecalledBytes(recorded[1])
        return SavedTensorMeter(self._parameter_storages, counted,
                                record=lambda nbytes: self._recorded.__setitem__(key, (signature, nbytes)))


class RecalledBytes:
    """:class:`SavedTensorMeter`'s interface without its hooks: the bytes a meter counted before."""

    def __init__(self, nbytes: int) -> None:
        self.bytes = nbytes

    def add(self, *tensors: torch.Tensor) -> None:
        """Counted when the figure was metered."""

    def __enter__(self) -> RecalledBytes:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


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


# (pid, a descriptor of that process's /proc/self/statm kept open, or None where there is no procfs)
_statm: tuple[int, int | None] | None = None


def rss_bytes() -> int:
    """Resident set size of this process now. Read every step by every worker, so on Linux
    it is one ``pread`` of ``/proc/self/statm`` on a descriptor kept open (~1.5 us, against
    ~25 us for a new ``psutil.Process().memory_info()``: 2-4% of a small stage's whole step in
    one process); "self" is resolved when it is opened, so a forked child, whose pid differs,
    closes the descriptor it inherited and opens its own. Without procfs, psutil's."""
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:
        if _statm is not None and _statm[1] is not None:
            os.close(_statm[1])  # the parent's, inherited across the fork
        try:
            _statm = pid, os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:  # no procfs (not Linux): asked once a process
            _statm = pid, None
    if _statm[1] is None:
        import psutil

        return psutil.Process().memory_info().rss
    return int(os.pread(_statm[1], 256, 0).split()[1]) * _PAGE_BYTES


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
