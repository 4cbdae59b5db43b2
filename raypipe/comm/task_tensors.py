"""Tensors as Ray task arguments and results, shipped as raw bytes.

Ray pickles a ``torch.Tensor`` through ``torch.save``, which costs about 0.5 ms
per small tensor on each side, and puts every argument over 100 KiB in the
object store on its own: with a step's micro-batches as task arguments that
was most of the driver's overhead. For large tensors it is slow too: a
worker's 17 MB state took 60-80 ms to put, against 5 ms as raw bytes.
:class:`TaskTensors` ships a list of CPU tensors as one byte buffer instead
(one object-store entry at most) and the worker gets them back as plain
writable tensors of the same dtypes and shapes; :class:`TaskTensor` does the
same for one tensor, without an extra copy (:func:`as_shipped_state` uses it
for a worker's state). A small buffer travels inside the pickle (``bytes``:
cheapest for what Ray inlines in the task), a large one as a numpy array,
which Ray ships out of band and maps without a copy.

Only host tensors travel: a tensor on a GPU would be pickled through torch,
readable only by a process with CUDA (the snapshot keeper has none), and
unpickled onto the receiver's GPU. :func:`as_task_argument` and
:func:`as_shipped_state` copy a device tensor to the host first (a
synchronous copy: a worker's state is staged on the host beforehand, see
:mod:`raypipe.stage.host_copy`); :class:`TaskTensor` and :class:`TaskTensors`
refuse one.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_ALIGN = 64  # bytes: every tensor starts aligned in the shared buffer
_IN_BAND_BYTES = 64 * 2**10  # up to this, the buffer is pickled in band

PiecesAt = list[tuple[str, tuple[int, ...], int]]  # dtype name, shape, byte offset


def _shippable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided


def _in_host_memory(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, refused unless in host memory."""
    if tensor.device.type != "cpu":
        raise ValueError(f"a task tensor must be in host memory, not on {tensor.device}: a receiver without that "
                         "device could not read it (as_task_argument and as_shipped_state copy it to the host)")
    return tensor


def _on_host(value: Any) -> Any:
    """A dense tensor on a device (a GPU) as a host copy; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu" and value.layout == torch.strided:
        return value.detach().cpu()
    return value


class TaskTensors:
    """CPU tensors that pickle as one byte array; unpickle as the list of tensors."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = [_in_host_memory(tensor) for tensor in tensors]

    def __reduce__(self) -> tuple:
        return _unpack, _pack(self.tensors)


class TaskTensor:
    """One CPU tensor that pickles as its bytes; unpickles as the tensor itself."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = _in_host_memory(tensor)

    def __reduce__(self) -> tuple:
        return _unpack_one, _pack([self.tensor])


def as_task_argument(value: Any) -> Any:
    """``value`` ready to travel as a task argument: a CPU tensor as a
    :class:`TaskTensor`, a list of them as one :class:`TaskTensors`."""
    value = [_on_host(v) for v in value] if isinstance(value, (list, tuple)) else _on_host(value)
    if isinstance(value, (list, tuple)) and value and all(_shippable(v) for v in value):
        return TaskTensors(value)
    if isinstance(value, (list, tuple)):
        return [as_task_argument(v) for v in value]
    if _shippable(value):
        return TaskTensor(value)
    if isinstance(value, torch.Tensor):
        return value.clone()  # a view would pickle its whole storage
    return value


def as_shipped_state(state: Any) -> Any:
    """``state`` (nested dicts, lists and tuples, such as a state dict) with every
    CPU tensor as a :class:`TaskTensor`: Ray copies each one once, straight into
    its buffer, when it serializes the value. The tensors are read then, not now:
    return it from a task (or put it) before they change. A tensor on a device is
    copied to the host here (so that no receiver needs that device)."""
    if isinstance(state, dict):
        shipped = copy.copy(state)  # keeps the kind and attributes (a state dict's _metadata)
        shipped.update((key, as_shipped_state(value)) for key, value in state.items())
        return shipped
    if isinstance(state, list):
        return [as_shipped_state(value) for value in state]
    if isinstance(state, tuple):
        return tuple(as_shipped_state(value) for value in state)
    state = _on_host(state)
    return TaskTensor(state) if _shippable(state) else state


def _pack(tensors: list[torch.Tensor]) -> tuple[np.ndarray | bytes, PiecesAt]:
    """One byte array with every tensor's own bytes (also for a view of a larger batch)."""
    pieces, pieces_at, offset = [], [], 0
    for tensor in map(_in_host_memory, tensors):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        padding = -offset % _ALIGN
        if padding:
            pieces.append(torch.zeros(padding, dtype=torch.uint8))
        offset += padding
        pieces.append(data)
        pieces_at.append((str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += data.numel()
    if len(pieces) == 1:
        buffer = pieces[0]  # its own bytes: copied once, when Ray serializes them, not here
    else:
        buffer = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    data = buffer.numpy()
    return (data.tobytes() if data.nbytes <= _IN_BAND_BYTES else data), pieces_at


def _unpack(data: np.ndarray | bytes, pieces_at: PiecesAt) -> list[torch.Tensor]:
    # the received bytes are read-only (Ray's buffer, or bytes): the copy is the worker's own
    array = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    buffer = torch.from_numpy(array.copy()) if array.size else torch.empty(0, dtype=torch.uint8)
    tensors = []
    for dtype_name, shape, offset in pieces_at:
        dtype = getattr(torch, dtype_name)
        size = math.prod(shape) * dtype.itemsize
        tensors.append(buffer[offset:offset + size].view(dtype).reshape(shape) if size
                       else torch.empty(shape, dtype=dtype))
    return tensors


def _unpack_one(data: np.ndarray | bytes, pieces_at: PiecesAt) -> torch.Tensor:
    return _unpack(data, pieces_at)[0]
