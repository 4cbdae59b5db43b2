"""Offload of kept stage inputs to Ray's object store.

On CPU the object store itself holds the tensor. On CUDA the tensor is copied
to pinned host memory on a side stream, so the copy overlaps the next
micro-batch's compute; it enters the object store once the copy has finished
(checked without blocking at every later offloader call). ``prefetch`` starts
the copy back to the device on the side stream ahead of the backward that
needs it.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import ray
import torch

from raypipe.stage import boundary


@dataclass
class OffloadedTensor:
    """A kept tensor off the device: in the object store (``ref``), or still
    being copied to pinned host memory (``host`` with its ``copied`` event)."""

    nbytes: int
    ref: Any = None
    host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None


class Offloader:
    """Moves tensors to the object store and back, asynchronously on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copying: list[OffloadedTensor] = []
        self._prefetched: dict[Hashable, torch.Tensor] = {}

    def put(self, tensor: torch.Tensor) -> OffloadedTensor:
        nbytes = tensor.numel() * tensor.element_size()
        if self._stream is None:
            return OffloadedTensor(nbytes, ref=ray.put(tensor.detach()))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        tensor.record_stream(self._stream)  # keep the device buffer until the copy has read it
        offloaded = OffloadedTensor(nbytes, host=host, copied=copied)
        self._copying.append(offloaded)
        self._store_finished_copies()
        return offloaded

    def prefetch(self, key: Hashable, offloaded: OffloadedTensor) -> None:
        """Start bringing ``offloaded`` back to the device (CUDA: on the side stream)."""
        if key in self._prefetched:
            return
        self._store_finished_copies()
        if self._stream is None:
            self._prefetched[key] = ray.get(offloaded.ref).clone()  # the store's buffer is read-only
            return
        host = offloaded.host if offloaded.host is not None else ray.get(offloaded.ref).pin_memory()
        with torch.cuda.stream(self._stream):
            self._prefetched[key] = host.to(self.device, non_blocking=True)

    def get(self, key: Hashable, offloaded: OffloadedTensor) -> torch.Tensor:
        """The tensor back on its device, waiting for a prefetch when one is running."""
        self.prefetch(key, offloaded)
        tensor = self._prefetched.pop(key)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return tensor

    def clear(self) -> None:
        """Drop what a step left here: inputs fetched ahead for backwards that never ran (a
        failed step's), and copies under way. A fetched input is found by its key (micro-batch
        and chunk), the same in every step: one left by a failed step would stand in for the
        input of the same key in the step run next (a replayed earlier step, another batch)."""
        self._prefetched.clear()
        self._copying.clear()

    def _store_finished_copies(self) -> None:
        """Hand host copies whose device-to-host transfer is done to the object store."""
        still_copying = []
        for offloaded in self._copying:
            if offloaded.copied.query():
                offloaded.ref, offloaded.host = ray.put(offloaded.host), None
            else:
                still_copying.append(offloaded)
        self._copying = still_copying


def check_offloadable(inputs: boundary.Boundary, stage: int) -> None:
    """The offloader keeps one tensor per micro-batch off the device: a tree input is refused."""
    if boundary.is_tree(inputs):
        raise ValueError(f"stage {stage}: offload_activations offloads a single-tensor stage input; this stage "
                         f"receives a tree ({boundary.describe(inputs)})\n"
                         "  set offload_activations=False (activation_checkpoint still recomputes from the kept "
                         "input, on the device)")
