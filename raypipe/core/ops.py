"""The op language of a pipeline step. No Ray, no torch.

A compute schedule is made of :class:`Op` (F or B of one micro-batch); lowering
(:mod:`raypipe.core.lowering`) turns it into :class:`LoweredOp` lists that also
say when tensors cross stage boundaries (SEND/RECV of activations and
gradients) and where the step's collectives run (REDUCE_GRAD, OPTIMIZER_STEP).
"""
from __future__ import annotations

from typing import NamedTuple

F, B = "F", "B"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
REDUCE_GRAD, OPTIMIZER_STEP = "REDUCE_GRAD", "OPTIMIZER_STEP"

# Activations flow to the next stage, gradients back to the previous one.
PEER_OFFSET = {SEND_ACT: +1, RECV_ACT: -1, SEND_GRAD: -1, RECV_GRAD: +1}


class Op(NamedTuple):
    """One op of one stage: ``kind`` is "F" or "B", on micro-batch ``micro_batch``."""

    kind: str
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


class LoweredOp(NamedTuple):
    """One op of a lowered stage.

    ``micro_batch`` is None for the collectives (REDUCE_GRAD, OPTIMIZER_STEP);
    ``peer`` is the other stage of a SEND/RECV and None otherwise.
    """

    kind: str
    micro_batch: int | None = None
    peer: int | None = None

    def __repr__(self) -> str:
        if self.micro_batch is None:
            return self.kind
        if self.peer is None:
            return f"{self.kind}{self.micro_batch}"
        arrow = "->" if self.kind.startswith("SEND") else "<-"
        return f"{self.kind}{self.micro_batch}{arrow}{self.peer}"
