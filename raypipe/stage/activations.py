"""What a stage keeps between a micro-batch's forward and its backward.

Per micro-batch either the autograd graph (inputs and outputs; all
activations stay alive) or only the stage input for re-materialization,
optionally offloaded to the object store. The store also tracks the bytes it
holds, for the memory measurement.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from raypipe.stage.offload import OffloadedTensor, Offloader


@dataclass
class Kept:
    """One micro-batch's kept state."""

    inputs: torch.Tensor | OffloadedTensor | None
    outputs: torch.Tensor | None  # graph root; None means recompute in backward
    held_bytes: int
    offloaded_bytes: int = 0
    extra: object = None  # e.g. the targets the last stage needs to recompute its loss
    rebuilt_bytes: int = 0  # what its recompute rebuilt (the fetched-back input included)


class ActivationStore:
    """Kept state per in-flight micro-batch (under a key: the worker's is :data:`raypipe.stage.chunks.Key`), with current
    and peak byte counts.

    ``backward_order`` is the stage's keys in the order their backwards take
    them: taking one starts fetching the next one's offloaded input."""

    def __init__(self, offloader: Offloader | None) -> None:
        self._offloader = offloader
        self._kept: dict[Hashable, Kept] = {}
        self.backward_order: list[Hashable] = []
        self.held_bytes = 0
        self.offloaded_bytes = 0
        self.peak_held_bytes = 0
        self.peak_offloaded_bytes = 0

    def reset_peaks(self) -> None:
        self.peak_held_bytes = self.held_bytes
        self.peak_offloaded_bytes = self.offloaded_bytes

    def keep_graph(self, micro_batch: Hashable, inputs: torch.Tensor, outputs: torch.Tensor,
                   saved_bytes: int) -> None:
        """Keep the whole autograd graph of this micro-batch."""
        self._add(micro_batch, Kept(inputs, outputs, saved_bytes))

    def keep_input(self, micro_batch: Hashable, inputs: torch.Tensor, input_bytes: int, extra: object = None) -> None:
        """Keep only the stage input (offloaded when configured); backward recomputes."""
        if self._offloader is not None:
            offloaded = self._offloader.put(inputs)
            self._add(micro_batch, Kept(offloaded, None, 0, offloaded.nbytes, extra))
        else:
            self._add(micro_batch, Kept(inputs, None, input_bytes, 0, extra))

    def take(self, micro_batch: Hashable) -> Kept:
        """Remove and return the kept state; offloaded inputs come back to the device, and the
        next backward's starts coming."""
        kept = self._kept.pop(micro_batch)
        if isinstance(kept.inputs, OffloadedTensor):
            kept.inputs = self._offloader.get(micro_batch, kept.inputs)
        if self._offloader is not None:
            self._prefetch_after(micro_batch)
        return kept

    def _prefetch_after(self, micro_batch: Hashable) -> None:
        """Start fetching the offloaded input of the backward that runs after ``micro_batch``'s."""
        position = self.backward_order.index(micro_batch) + 1
        if position < len(self.backward_order):
            following = self.backward_order[position]
            kept = self._kept.get(following)
            if kept is not None and isinstance(kept.inputs, OffloadedTensor):
                self._offloader.prefetch(following, kept.inputs)

    def retain_rebuilt(self, kept: Kept) -> None:
        """A split backward's I keeps its recomputed graph (retained for the weight gradient)
        held until its W releases ``kept``."""
        kept.held_bytes += kept.rebuilt_bytes
        self.held_bytes += kept.rebuilt_bytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def release(self, kept: Kept) -> None:
        """Account for a taken micro-batch whose backward finished."""
        self.held_bytes -= kept.held_bytes
        self.offloaded_bytes -= kept.offloaded_bytes

    def note_transient(self, nbytes: int) -> None:
        """A recompute briefly holds ``nbytes`` more than what is kept."""
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes + nbytes)

    def clear(self) -> None:
        self._kept.clear()
        if self._offloader is not None:
            self._offloader.clear()
        self.held_bytes = self.offloaded_bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def _add(self, micro_batch: Hashable, kept: Kept) -> None:
        if micro_batch in self._kept:
            chunk, number = micro_batch if isinstance(micro_batch, tuple) else (0, micro_batch)
            what = f"micro-batch {number}" + (f" of chunk {chunk}" if chunk else "")
            raise RuntimeError(f"{what} already has a forward without backward")
        self._kept[micro_batch] = kept
        self.held_bytes += kept.held_bytes
        self.offloaded_bytes += kept.offloaded_bytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self.peak_offloaded_bytes = max(self.peak_offloaded_bytes, self.offloaded_bytes)
