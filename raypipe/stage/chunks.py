"""A worker's model chunks (``virtual_stages``): where each chunk's layers sit among the
worker's, which chunk starts and which ends the model, each chunk's parameters, and which
of a step's backwards have not run.

One chunk per worker is the plain pipeline: chunk 0, all the layers.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from torch import nn

from raypipe.stage.spec import WorkerSpec

Key = tuple[int, int]  # (chunk, micro-batch): what a worker keeps a micro-batch's state under


@dataclass(frozen=True)
class Chunks:
    """``positions[c]``: where chunk c's layers are in the worker's; ``reads_inputs``: the worker's
    chunk 0 is the model's first virtual stage; ``last``: its chunk that is the model's last
    (it computes the loss), or None."""

    positions: tuple[range, ...]
    reads_inputs: bool
    last: int | None

    @classmethod
    def of(cls, spec: WorkerSpec) -> Chunks:
        return cls(tuple(spec.chunk_positions(chunk) for chunk in range(spec.num_chunks)), spec.is_first,
                   spec.last_chunk)

    def __len__(self) -> int:
        return len(self.positions)

    def is_first(self, chunk: int) -> bool:
        """Whether ``chunk`` is the model's first virtual stage (data in, no input gradient out)."""
        return self.reads_inputs and chunk == 0

    def parameters(self, layers: nn.ModuleList, keep: Callable[[nn.Parameter], bool]) -> list[list[nn.Parameter]]:
        """Per chunk, in order, the parameters of its layers that ``keep`` keeps."""
        return [[p for position in positions for p in layers[position].parameters() if keep(p)]
                for positions in self.positions]

    def missing_backwards(self, done: Collection[Key], num_micro_batches: int) -> list[Key]:
        """The (chunk, micro-batch)s of a step of ``num_micro_batches`` whose backward is not in ``done``."""
        return sorted({(chunk, micro_batch) for chunk in range(len(self)) for micro_batch in range(num_micro_batches)}
                      - set(done))

    def describe(self, keys: list[Key]) -> list:
        """``keys`` as an error names them: micro-batches, with their chunk where there are several."""
        if len(self) == 1:
            return [micro_batch for _, micro_batch in keys]
        return [f"{micro_batch} (chunk {chunk})" for chunk, micro_batch in keys]
