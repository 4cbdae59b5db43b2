"""Dry-run of lowered schedules: catch hangs and mis-paired tensors before any
worker starts. No Ray, no torch.

The model is the one NCCL imposes at run time: each stage runs its ops in order;
sends are buffered and never block; a receive blocks until its sender has sent;
point-to-point messages are matched in order per (sender, receiver, kind); a
collective completes only once every stage has reached it.
"""
from __future__ import annotations

from collections import defaultdict, deque

from raypipe.core.ops import (B, F, OPTIMIZER_STEP, PEER_OFFSET, RECV_ACT, RECV_GRAD, REDUCE_GRAD,
                                   SEND_ACT, SEND_GRAD, LoweredOp)

_COLLECTIVES = (REDUCE_GRAD, OPTIMIZER_STEP)
_SEND_MATCHING = {RECV_ACT: SEND_ACT, RECV_GRAD: SEND_GRAD}


class ScheduleError(ValueError):
    """A schedule that would fail or hang at run time; the message names the stage(s) and op(s)."""


def simulate(lowered: list[list[LoweredOp]]) -> list[tuple[int, LoweredOp]]:
    """Dry-run ``lowered`` (``lowered[stage]`` = that stage's ops, in order).

    Returns every ``(stage, op)`` in the order it ran, a topological order the
    executor can submit in: each stage's order is kept and every RECV comes after
    its SEND. The order is round-robin: in each sweep, stages 0..p-1 in turn run
    one op each if their next op can run; then, if every stage waits on the same
    collective, it runs on all stages, in stage order.

    Raises :class:`ScheduleError` for F/B ops out of place, a SEND/RECV with the
    wrong peer, a receive that would get another micro-batch's message
    ("mismatch"), stages that all wait ("deadlock") and messages never received.
    """
    _check_stages(lowered)
    run = _Run(lowered)
    while not run.finished():
        if not run.sweep():
            raise ScheduleError(run.deadlock_message())
    run.check_all_received()
    return run.order


def _check_stages(lowered: list[list[LoweredOp]]) -> None:
    # Every stage must run F and B once for each micro-batch 0..m-1, so m is the
    # number of distinct micro-batches among all compute ops.
    num_micro_batches = len({op.micro_batch for ops in lowered for op in ops if op.kind in (F, B)})
    for stage, ops in enumerate(lowered):
        _check_stage(stage, ops, len(lowered), num_micro_batches)


def _check_stage(stage: int, ops: list[LoweredOp], num_stages: int, num_micro_batches: int) -> None:
    done: set[LoweredOp] = set()
    for op in ops:
        _check_op(stage, op, num_stages, num_micro_batches)
        for needed in _inputs(stage, op, num_stages):
            if needed not in done:
                raise ScheduleError(f"stage {stage}: {op!r} runs before {needed!r}, which it needs")
        if op.kind in (F, B) and op in done:
            raise ScheduleError(f"stage {stage}: {op!r} runs twice")
        done.add(op)
    for micro_batch in range(num_micro_batches):
        for kind in (F, B):
            if LoweredOp(kind, micro_batch) not in done:
                raise ScheduleError(f"stage {stage}: {kind}{micro_batch} is missing")


def _check_op(stage: int, op: LoweredOp, num_stages: int, num_micro_batches: int) -> None:
    if op.kind in (F, B):
        if op.micro_batch not in range(num_micro_batches):
            raise ScheduleError(f"stage {stage}: {op!r} has a micro-batch outside 0..{num_micro_batches - 1}")
    elif op.kind in PEER_OFFSET:
        peer = stage + PEER_OFFSET[op.kind]
        if not 0 <= peer < num_stages:
            raise ScheduleError(f"stage {stage}: {op!r} has no neighbour to talk to ({num_stages} stages)")
        if op.peer != peer:
            raise ScheduleError(f"stage {stage}: {op!r} must have peer {peer}")
    elif op.kind not in _COLLECTIVES:
        raise ScheduleError(f"stage {stage}: unknown op kind {op.kind!r} in {op!r}")


def _inputs(stage: int, op: LoweredOp, num_stages: int) -> list[LoweredOp]:
    """The ops that must already have run on ``stage`` for ``op`` to have its tensors."""
    micro_batch = op.micro_batch
    if op.kind == F:
        return [LoweredOp(RECV_ACT, micro_batch, stage - 1)] if stage > 0 else []
    if op.kind == B:
        gradient = [LoweredOp(RECV_GRAD, micro_batch, stage + 1)] if stage < num_stages - 1 else []
        return [LoweredOp(F, micro_batch)] + gradient
    if op.kind == SEND_ACT:
        return [LoweredOp(F, micro_batch)]
    if op.kind == SEND_GRAD:
        return [LoweredOp(B, micro_batch)]
    return []


class _Run:
    """The state of a dry-run: where each stage is and the messages in flight."""

    def __init__(self, lowered: list[list[LoweredOp]]) -> None:
        self.lowered = lowered
        self.position = [0] * len(lowered)
        # (sender, receiver, send kind) -> the SEND ops not yet received, oldest first
        self.channels: defaultdict[tuple[int, int, str], deque[LoweredOp]] = defaultdict(deque)
        self.order: list[tuple[int, LoweredOp]] = []
        self.total = sum(len(ops) for ops in lowered)

    def next_op(self, stage: int) -> LoweredOp | None:
        ops = self.lowered[stage]
        return ops[self.position[stage]] if self.position[stage] < len(ops) else None

    def finished(self) -> bool:
        return len(self.order) == self.total

    def sweep(self) -> bool:
        """One round-robin sweep; False when nothing could run."""
        progressed = False
        for stage in range(len(self.lowered)):
            if self._can_run(stage):
                self._run(stage)
                progressed = True
        if self._collective_ready():
            for stage in range(len(self.lowered)):
                self._run(stage)
            progressed = True
        return progressed

    def _collective_ready(self) -> bool:
        # Collectives of a kind always run on all stages together, so reaching
        # the same kind also means reaching the same count of it.
        first = self.next_op(0)
        if first is None or first.kind not in _COLLECTIVES:
            return False
        others = (self.next_op(stage) for stage in range(1, len(self.lowered)))
        return all(op is not None and op.kind == first.kind for op in others)

    def _channel(self, stage: int, recv: LoweredOp) -> deque[LoweredOp]:
        return self.channels[(recv.peer, stage, _SEND_MATCHING[recv.kind])]

    def _can_run(self, stage: int) -> bool:
        op = self.next_op(stage)
        if op is None or op.kind in _COLLECTIVES:
            return False
        return op.kind not in _SEND_MATCHING or bool(self._channel(stage, op))

    def _run(self, stage: int) -> None:
        op = self.next_op(stage)
        if op.kind in (SEND_ACT, SEND_GRAD):
            self.channels[(stage, op.peer, op.kind)].append(op)
        elif op.kind in _SEND_MATCHING:
            sent = self._channel(stage, op).popleft()
            if sent.micro_batch != op.micro_batch:
                # NCCL pairs point-to-point ops in order: this would hand over the wrong tensor.
                raise ScheduleError(
                    f"mismatch: stage {stage} runs {op!r} but the oldest message from stage {op.peer} "
                    f"is its {sent!r} (micro-batch {sent.micro_batch}, not {op.micro_batch})")
        self.order.append((stage, op))
        self.position[stage] += 1

    def deadlock_message(self) -> str:
        states = []
        for stage in range(len(self.lowered)):
            op = self.next_op(stage)
            states.append(f"stage {stage} has finished" if op is None else f"stage {stage} waits on {op!r}")
        return "deadlock: " + "; ".join(states)

    def check_all_received(self) -> None:
        for (sender, receiver, _), pending in self.channels.items():
            if pending:
                raise ScheduleError(f"stage {sender} ran {pending[0]!r} but stage {receiver} never received it")
