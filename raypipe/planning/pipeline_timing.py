"""The timed pipeline the predictor reads, evaluated without the dry-run: the rule of
:func:`raypipe.core.timed_simulation.simulate_timed` with ``buffered_sends=True``, for
lowered schedules already known to run (the search's gpipe, 1F1B and zb_h1, whose builders
and lowering the schedule and lowering tests dry-run).

Why a second evaluation of the same rule: ``simulate_timed`` takes its order of ops from
:func:`raypipe.core.simulator.simulate`, which first checks every op of every worker and then
runs round-robin sweeps; at 128 stages and 512 micro-batches that is ~80% of the search's time
for a rule whose figures need no order at all. Each time below is a max or a sum of the same
operands ``simulate_timed`` uses (an op's start is its worker's previous end; a compute op ends
its time later; a receive when its message arrives, its send's posting plus the message's time; a
buffered send at once; a collective when the last worker reaches it, plus its time), so the
figures are equal to the last bit whatever order the ops are evaluated in.
``tests/planning/test_pipeline_timing.py`` checks that they are, against ``simulate_timed``.

What it does not do: check the schedule (a mis-paired message or an op out of place gives
figures, not a :class:`~raypipe.core.simulator.ScheduleError`; only a deadlock raises one),
check the times (they are the predictor's, finite and >= 0), or keep a timeline.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raypipe.core.ops import COLLECTIVES, EXCHANGE, RECEIVES, SENDS, B, F, I, LoweredOp, W
from raypipe.core.simulator import ScheduleError

_MESSAGES = (*SENDS, *RECEIVES, EXCHANGE)
_COMPUTE = (F, B, I, W)


@dataclass(frozen=True)
class PipelineTiming:
    """One timed step: its length, and per worker its busy seconds (its compute ops' times), the
    end of its last compute op (F, B, I, W; 0 with none) and when it first posts a receive (inf
    with none); ``compute_ops`` counts the F, B, I and W ops of all workers."""

    step_s: float
    busy_s: tuple[float, ...]
    last_compute: tuple[float, ...]
    first_wait: tuple[float, ...]
    compute_ops: int


def time_buffered_pipeline(lowered: Sequence[Sequence[LoweredOp]], op_seconds: Callable[[int, LoweredOp], float],
                           message_seconds: Callable[[int, int, LoweredOp], float]) -> PipelineTiming:
    """``lowered`` (per worker, its ops in order) timed as ``simulate_timed(lowered, op_seconds,
    message_seconds, buffered_sends=True)`` times it (see the module docstring): ``op_seconds(stage,
    op)`` for compute ops and collectives, ``message_seconds(sender, receiver, send)`` per message.

    Raises :class:`~raypipe.core.simulator.ScheduleError` where no worker can go on.
    """
    num_stages = len(lowered)
    position = [0] * num_stages
    free_at = [0.0] * num_stages  # when each worker completed its last op: when it posts the next
    sends_posted = [False] * num_stages  # whether the worker's next op (a message op) has posted its sends
    # per (sender, receiver): when each message posted and not yet received arrives, in issue order
    # (two workers' messages match in issue order)
    in_flight: dict[tuple[int, int], deque[float]] = {}
    busy = [0.0] * num_stages
    last_compute = [0.0] * num_stages
    first_wait = [math.inf] * num_stages
    compute_ops = 0
    remaining = sum(len(ops) for ops in lowered)
    while remaining:
        progressed = False
        for stage in range(num_stages):
            ops = lowered[stage]
            while position[stage] < len(ops):
                op = ops[position[stage]]
                start = free_at[stage]
                if op.kind in COLLECTIVES:
                    break  # run below, once every worker has reached it
                if op.kind in _MESSAGES:
                    parts = op.unbatched()
                    if not sends_posted[stage]:  # its sends leave as it is posted, before it completes
                        for part in parts:
                            if part.kind in SENDS:
                                in_flight.setdefault((stage, part.peer), deque()).append(
                                    start + message_seconds(stage, part.peer, part))
                        sends_posted[stage] = True
                    senders = [part.peer for part in parts if part.kind in RECEIVES]
                    if not _all_sent(senders, stage, in_flight):
                        break  # it waits for a message not yet sent
                    end = start  # a buffered send holds nobody
                    for sender in senders:
                        end = max(end, in_flight[(sender, stage)].popleft())
                    if senders:
                        first_wait[stage] = min(first_wait[stage], start)
                    sends_posted[stage] = False
                else:
                    seconds = op_seconds(stage, op)
                    end = start + seconds
                    busy[stage] += seconds
                    if op.kind in _COMPUTE:
                        last_compute[stage] = max(last_compute[stage], end)
                        compute_ops += 1
                free_at[stage] = end
                position[stage] += 1
                remaining -= 1
                progressed = True
        waiting = [ops[position[stage]] if position[stage] < len(ops) else None for stage, ops in enumerate(lowered)]
        if all(op is not None and op.kind in COLLECTIVES for op in waiting):
            # a collective starts once every worker has reached it, and then takes its time on each
            collective_start = max(free_at)
            for stage, op in enumerate(waiting):
                free_at[stage] = collective_start + op_seconds(stage, op)
                position[stage] += 1
                remaining -= 1
            progressed = True
        if not progressed:
            stuck = ", ".join(f"stage {stage}: {op!r}" for stage, op in enumerate(waiting) if op is not None)
            raise ScheduleError(f"deadlock: every worker waits ({stuck})")
    return PipelineTiming(step_s=max(free_at, default=0.0), busy_s=tuple(busy), last_compute=tuple(last_compute),
                          first_wait=tuple(first_wait), compute_ops=compute_ops)


def _all_sent(senders: list[int], stage: int, in_flight: dict[tuple[int, int], deque[float]]) -> bool:
    """Whether every message one op of ``stage`` receives (one per entry of ``senders``, the stage
    each comes from) has been sent."""
    if len(senders) == 1:  # the usual case: one receive, alone or with sends
        return bool(in_flight.get((senders[0], stage)))
    return all(len(in_flight.get((sender, stage), ())) >= senders.count(sender) for sender in senders)
