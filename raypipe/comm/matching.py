"""How a point-to-point message finds its receive: by (peer, tag) on gloo
(:class:`ByTag`: receives posted ahead, payload shapes predicted), or in stream
order on NCCL and its emulation (:class:`InOrder`: tags ignored, nothing posted
ahead, operations started together in one batch). The tag of a message comes
from its kind (:data:`HEADER`, :data:`PREDICTED`, :data:`UNPREDICTED`,
:data:`GRADIENT`, a tree's :data:`LAYOUT`, or the step's :data:`STATISTICS`, which
go on the control channel with key 0) and its message key
(:func:`raypipe.core.ops.message_key`: the micro-batch and the chunk boundary it
crosses), ``KINDS * key + kind + 1``: gloo's tags are 32-bit, and keys stay small.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from raypipe.comm.nccl_emulation import EmulatedStream

# what a message is, for its tag
HEADER, PREDICTED, UNPREDICTED, GRADIENT, LAYOUT, STATISTICS = range(6)
KINDS = 6

# a point-to-point operation to start: dist.isend or dist.irecv, the tensor, the peer's rank, the tag
Operation = tuple[Any, torch.Tensor, int, int]


class ByTag:
    """Gloo: messages match by (peer, tag), so receives are posted ahead and
    payload shapes are predicted."""

    predicts = True

    @staticmethod
    def tag(kind: int, key: int) -> int:
        return KINDS * key + kind + 1

    def post(self, buffer: torch.Tensor, peer: int, kind: int, key: int) -> Any:
        return dist.irecv(buffer, peer, tag=self.tag(kind, key))

    @staticmethod
    def start(operations: list[Operation]) -> list[Any]:
        """Start each operation on its own: one Work each."""
        return [function(tensor, peer, tag=tag) for function, tensor, peer, tag in operations]


class InOrder:
    """NCCL: messages match in stream order and tags are ignored, so nothing is
    posted ahead (None) and nothing is predicted. ``stream``: NCCL's emulation
    runs the batches (:mod:`raypipe.comm.nccl_emulation`)."""

    predicts = False

    def __init__(self, stream: EmulatedStream | None = None) -> None:
        self.stream = stream

    @staticmethod
    def tag(kind: int, key: int) -> int:
        return 0

    def post(self, buffer: torch.Tensor, peer: int, kind: int, key: int) -> None:
        return None

    def start(self, operations: list[Operation]) -> list[Any]:
        """Post ``operations`` together (one NCCL group), on the group's communicator."""
        if self.stream is not None:
            return self.stream.start(operations)
        return dist.batch_isend_irecv([dist.P2POp(function, tensor, peer, tag=tag)
                                       for function, tensor, peer, tag in operations])
