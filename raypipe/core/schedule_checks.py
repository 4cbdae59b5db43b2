"""Static checks of a lowered schedule, run before the dry-run (:mod:`raypipe.core.simulator`)
moves a single message. Each worker's ops are checked alone: every op kind is known, each send and
receive names the neighbouring worker of its chunk (never its own), an EXCHANGE holds only sends and
receives and awaits headers of its own activation receives only (none behind a payload it receives
after its batch from the same peer), every op comes after the ops whose tensors it needs, and each
chunk runs F once and then one backward (B, or I and then W) for every micro-batch. Then the sends
and receives between each pair of workers are counted against each other. These are the faults
that need no run to find, and finding them first lets the dry-run's messages speak only of what
happens between workers (a deadlock or a mismatched message). No Ray, no torch.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from raypipe.core.ops import (COLLECTIVES, COMPUTE, EXCHANGE, PEER_OFFSET, RECEIVES, RECV_ACT, RECV_GRAD, SEND_ACT,
                              SEND_GRAD, SENDS, B, F, I, LoweredOp, W, neighbour, unbatch)


class ScheduleError(ValueError):
    """A schedule that would fail or hang at run time; the message names the stage(s) and op(s)."""


def check_schedule(lowered: list[list[LoweredOp]], placement: str) -> int:
    """Check ``lowered`` (``lowered[stage]`` = that stage's ops, in order), whose chunks are placed
    on the workers by ``placement``, as this module's docstring says; return the number of chunks
    per worker (v). Raises :class:`ScheduleError` naming the first fault found.

    Every worker must run, for each of its chunks and each micro-batch, F once and then either
    B once or I once and W after it; F after what it needs (the received activation, or the other
    chunk's F where the previous virtual stage is on the same worker), B/I after F and after what
    they need (the received gradient, or the other chunk's B/I on the same worker)."""
    num_chunks = _check_stages(lowered, placement)
    _check_message_counts(lowered)
    return num_chunks


def _check_stages(lowered: list[list[LoweredOp]], placement: str) -> int:
    """Check each worker's ops alone; return the number of chunks per worker (v)."""
    # Every worker must run F and a backward once for each chunk 0..v-1 and micro-batch 0..m-1, so
    # m is the number of distinct micro-batches and v the number of distinct chunks among all compute ops.
    compute = [op for ops in lowered for op in ops if op.kind in COMPUTE]
    num_micro_batches = len({op.micro_batch for op in compute})
    num_chunks = 1 + max((op.chunk for op in compute), default=0)
    for stage, ops in enumerate(lowered):
        _check_stage(stage, ops, _Shape(len(lowered), num_micro_batches, num_chunks, placement))
    return num_chunks


@dataclass(frozen=True)
class _Shape:
    """What a worker's ops are checked against: p workers, m micro-batches, v chunks placed by ``placement``."""

    num_stages: int
    num_micro_batches: int
    num_chunks: int
    placement: str

    def neighbour(self, stage: int, chunk: int, kind: str) -> tuple[int, int] | None:
        return neighbour(stage, chunk, kind, self.num_stages, self.num_chunks, self.placement)


def _check_stage(stage: int, ops: list[LoweredOp], shape: _Shape) -> None:
    done: set[LoweredOp] = set()
    for op in ops:
        _check_op(stage, op, shape)
        for part in op.unbatched():  # an exchange's sends need their tensors before it posts
            for needed in _inputs(stage, part, shape):
                if not done.intersection(needed):
                    raise ScheduleError(f"stage {stage}: {part!r} runs before "
                                        f"{' or '.join(map(repr, needed))}, which it needs")
        if op.kind in COMPUTE and op in done:
            raise ScheduleError(f"stage {stage}: {op!r} runs twice")
        if op.kind in (B, I) and _compute(B if op.kind == I else I, op) in done:
            raise ScheduleError(f"stage {stage}: {op!r} and {_compute(B if op.kind == I else I, op)!r} both run "
                                f"(a backward is one B, or an I and a W)")
        done.update(op.unbatched())
    for chunk in range(shape.num_chunks):
        for micro_batch in range(shape.num_micro_batches):
            forward, whole, input_gradient, weight_gradient = (LoweredOp(kind, micro_batch, chunk=chunk)
                                                               for kind in (F, B, I, W))
            if forward not in done:
                raise ScheduleError(f"stage {stage}: {forward!r} is missing")
            if whole not in done and input_gradient not in done:
                raise ScheduleError(f"stage {stage}: {whole!r} (or {input_gradient!r} and {weight_gradient!r}) "
                                    f"is missing")
            if input_gradient in done and weight_gradient not in done:
                raise ScheduleError(f"stage {stage}: {weight_gradient!r} is missing (after {input_gradient!r})")


def _compute(kind: str, op: LoweredOp) -> LoweredOp:
    """The compute op ``kind`` of ``op``'s micro-batch and chunk."""
    return LoweredOp(kind, op.micro_batch, chunk=op.chunk)


def _check_op(stage: int, op: LoweredOp, shape: _Shape) -> None:
    if op.kind in COMPUTE:
        if op.micro_batch not in range(shape.num_micro_batches):
            raise ScheduleError(f"stage {stage}: {op!r} has a micro-batch outside 0..{shape.num_micro_batches - 1}")
    elif op.kind in PEER_OFFSET:
        if op.chunk not in range(shape.num_chunks):
            raise ScheduleError(f"stage {stage}: {op!r} names a chunk outside 0..{shape.num_chunks - 1}")
        other = shape.neighbour(stage, op.chunk, op.kind)
        if other is None:
            raise ScheduleError(f"stage {stage}: {op!r} has no neighbour to talk to ({shape.num_stages} stages"
                                + (f", {shape.num_chunks} chunks each)" if shape.num_chunks > 1 else ")"))
        if other[0] == stage:
            raise ScheduleError(f"stage {stage}: {op!r} talks to its own worker (chunk {other[1]} is here too: "
                                f"it uses the tensor without a message)")
        if op.peer != other[0]:
            raise ScheduleError(f"stage {stage}: {op!r} must have peer {other[0]}")
    elif op.kind == EXCHANGE:
        if not op.parts or any(part.kind not in PEER_OFFSET for part in op.parts):
            raise ScheduleError(f"stage {stage}: an EXCHANGE holds one or more sends and receives, "
                                f"not {list(op.parts)!r}")
        for part in op.parts:
            _check_op(stage, part, shape)
        _check_header_first(stage, op)
    elif op.kind not in COLLECTIVES:
        raise ScheduleError(f"stage {stage}: unknown op kind {op.kind!r} in {op!r}")


def _check_header_first(stage: int, op: LoweredOp) -> None:
    """An EXCHANGE awaits headers of its own RECV_ACT parts only, and none behind a payload it
    receives after the batch from the same peer (it would be issued after that one all the same)."""
    for part in op.header_first:
        if part.kind != RECV_ACT or part not in op.parts:
            raise ScheduleError(f"stage {stage}: {op!r} awaits the header of {part!r}, which is not one of its "
                                f"RECV_ACT parts")
    received_after_from: set[int] = set()  # peers of the RECV_ACT parts received after the batch, so far
    for part in op.parts:
        if part in op.header_first and part.peer in received_after_from:
            raise ScheduleError(f"stage {stage}: {op!r} awaits the header of {part!r} but receives an earlier "
                                f"activation from stage {part.peer} after its batch (a pair's messages are issued "
                                f"in order): await that one's header too")
        if part.kind == RECV_ACT and part not in op.header_first:
            received_after_from.add(part.peer)


def _inputs(stage: int, op: LoweredOp, shape: _Shape) -> list[tuple[LoweredOp, ...]]:
    """The ops that must already have run on ``stage`` for ``op`` to have its tensors: each
    entry is a choice of ops, one of which must have run (the input gradient comes from a B or an I)."""
    if op.kind == F:
        return _from_neighbour(stage, op, RECV_ACT, (F,), shape)
    if op.kind in (B, I):
        return [(_compute(F, op),)] + _from_neighbour(stage, op, RECV_GRAD, (B, I), shape)
    if op.kind == W:
        return [(_compute(I, op),)]
    if op.kind == SEND_ACT:
        return [(_compute(F, op),)]
    if op.kind == SEND_GRAD:
        return [(_compute(B, op), _compute(I, op))]
    return []


def _from_neighbour(stage: int, op: LoweredOp, receive: str, local_kinds: tuple[str, ...],
                    shape: _Shape) -> list[tuple[LoweredOp, ...]]:
    """What ``op`` needs from the neighbouring virtual stage: nothing at an end of the pipeline,
    that chunk's op (one of ``local_kinds``) where it is on this worker, else the receive."""
    other = shape.neighbour(stage, op.chunk, receive)
    if other is None:
        return []
    if other[0] == stage:
        return [tuple(LoweredOp(kind, op.micro_batch, chunk=other[1]) for kind in local_kinds)]
    return [(LoweredOp(receive, op.micro_batch, other[0], chunk=op.chunk),)]


def _check_message_counts(lowered: list[list[LoweredOp]]) -> None:
    """Every send has a receive and every receive a send, counted per (sender, receiver)."""
    sends: defaultdict[tuple[int, int], list[LoweredOp]] = defaultdict(list)
    receives: defaultdict[tuple[int, int], list[LoweredOp]] = defaultdict(list)
    for stage, ops in enumerate(lowered):
        for op in unbatch(ops):
            if op.kind in SENDS:
                sends[(stage, op.peer)].append(op)
            elif op.kind in RECEIVES:
                receives[(op.peer, stage)].append(op)
    for (sender, receiver) in sorted(set(sends) | set(receives)):
        sent, received = sends[(sender, receiver)], receives[(sender, receiver)]
        if len(sent) > len(received):
            raise ScheduleError(f"stage {sender} runs {sent[len(received)]!r} but stage {receiver} never receives "
                                f"it ({len(sent)} sends to it, {len(received)} receives)")
        if len(received) > len(sent):
            raise ScheduleError(f"stage {receiver} runs {received[len(sent)]!r} but stage {sender} never sends "
                                f"it ({len(received)} receives from it, {len(sent)} sends)")
