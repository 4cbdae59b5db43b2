"""Offload of kept stage inputs to Ray's object store.

On CPU the object store itself holds the tensor. On CUDA the tensor is first
copied to pinned host memory on a side stream, so the copy overlaps compute;
``prefetch`` starts the copy back to the device ahead of the backward that
needs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch


@dataclass
class OffloadedTensor:
    """A kept tensor living in the object store (``ref``) until fetched back."""

    ref: Any
    nbytes: int
    device: torch.device
    ready: torch.cuda.Event | None = None


class Offloader:
    """Moves tensors to the object store and back, asynchronously on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._prefetched: dict[int, torch.Tensor] = {}

    def put(self, tensor: torch.Tensor) -> OffloadedTensor:
        nbytes = tensor.numel() * tensor.element_size()
        if self._stream is None:
            return OffloadedTensor(ray.put(tensor.detach()), nbytes, tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor.detach(), non_blocking=True)
            tensor.record_stream(self._stream)
        self._stream.synchronize()
        return OffloadedTensor(ray.put(host), nbytes, tensor.device)

    def prefetch(self, key: int, offloaded: OffloadedTensor) -> None:
        """Start bringing ``offloaded`` back to the device (CUDA: on the side stream)."""
        if key in self._prefetched:
            return
        host = ray.get(offloaded.ref)
        if self._stream is None:
            self._prefetched[key] = host.clone()  # the store's buffer is read-only
            return
        with torch.cuda.stream(self._stream):
            self._prefetched[key] = host.pin_memory().to(self.device, non_blocking=True)

    def get(self, key: int, offloaded: OffloadedTensor) -> torch.Tensor:
        """The tensor back on its device, waiting for a prefetch when one is running."""
        self.prefetch(key, offloaded)
        tensor = self._prefetched.pop(key)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return tensor
