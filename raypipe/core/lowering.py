"""Lower a compute-only schedule into per-stage ops with explicit communication.

A schedule says only in which order each stage runs F and B; the executor also
needs to know when activations and gradients cross stage boundaries. Like
``torch.distributed.pipelining``'s ``_add_send_recv``, :func:`lower` puts a
receive right before each compute op that needs a neighbour's tensor and a send
right after each compute op whose output a neighbour needs, then closes every
stage with the step's collectives. No Ray, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence

from raypipe.core.ops import (B, F, OPTIMIZER_STEP, PEER_OFFSET, RECV_ACT, RECV_GRAD, REDUCE_GRAD, SEND_ACT, SEND_GRAD,
                              LoweredOp, Op)

# Per compute kind: the receive of its input and the send of its output.
_COMMUNICATION = {F: (RECV_ACT, SEND_ACT), B: (RECV_GRAD, SEND_GRAD)}


def lower(schedule: list[list[Op]]) -> list[list[LoweredOp]]:
    """Per stage, its F/B ops with the sends, receives and collectives they imply.

    Before F(mb) on a stage s > 0: RECV_ACT(mb) from s-1; after F(mb) on
    s < p-1: SEND_ACT(mb) to s+1. Before B(mb) on s < p-1: RECV_GRAD(mb) from
    s+1; after B(mb) on s > 0: SEND_GRAD(mb) to s-1. After the last op of every
    stage: REDUCE_GRAD, then OPTIMIZER_STEP.
    """
    num_stages = len(schedule)
    return [lower_stage(stage, ops, num_stages) for stage, ops in enumerate(schedule)]


def lower_stage(stage: int, ops: Sequence[Op], num_stages: int) -> list[LoweredOp]:
    """The lowered ops of ``stage`` alone (see :func:`lower`)."""
    lowered = []
    for op in ops:
        if op.kind not in _COMMUNICATION:
            raise ValueError(f"stage {stage}: unknown op kind {op.kind!r} in {op!r}")
        recv, send = _COMMUNICATION[op.kind]
        if 0 <= stage + PEER_OFFSET[recv] < num_stages:
            lowered.append(LoweredOp(recv, op.micro_batch, stage + PEER_OFFSET[recv]))
        lowered.append(LoweredOp(op.kind, op.micro_batch))
        if 0 <= stage + PEER_OFFSET[send] < num_stages:
            lowered.append(LoweredOp(send, op.micro_batch, stage + PEER_OFFSET[send]))
    return lowered + [LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)]
