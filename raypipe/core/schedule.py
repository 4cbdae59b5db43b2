"""Pipeline schedules as pure data: per stage, the ordered ops. No Ray, no torch.

A schedule is ``list[list[Op]]``: ``schedule[stage]`` is the order in which that
stage runs its forward (F) and backward (B) ops. The driver submits each
stage's ops in exactly this order, so the submission order *is* the schedule.
"""
from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b")


class Op(NamedTuple):
    """One op of one stage: ``kind`` is "F" or "B", on micro-batch ``micro_batch``."""

    kind: str
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def gpipe_schedule(num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """GPipe: every stage runs all forwards, then all backwards in reverse order."""
    _check_sizes(num_stages, num_micro_batches)
    forwards = [Op("F", mb) for mb in range(num_micro_batches)]
    backwards = [Op("B", mb) for mb in reversed(range(num_micro_batches))]
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b_schedule(num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """1F1B (PipeDream-flush): warm-up forwards, then alternate F and B, then cool-down.

    Stage ``s`` keeps at most ``num_stages - s`` micro-batches in flight, instead
    of all ``num_micro_batches`` as in GPipe; the bubble is the same.
    """
    _check_sizes(num_stages, num_micro_batches)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_micro_batches)
        ops = [Op("F", mb) for mb in range(warmup)]
        next_forward, next_backward = warmup, 0
        while next_backward < num_micro_batches:
            if next_forward < num_micro_batches:
                ops.append(Op("F", next_forward))
                next_forward += 1
            ops.append(Op("B", next_backward))
            next_backward += 1
        schedule.append(ops)
    return schedule


def make_schedule(name: str, num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """The schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name == "gpipe":
        return gpipe_schedule(num_stages, num_micro_batches)
    if name == "1f1b":
        return one_f_one_b_schedule(num_stages, num_micro_batches)
    raise ValueError(f"unknown schedule {name!r}: expected one of {SCHEDULES}")


def submission_order(schedule: list[list[Op]]) -> list[tuple[int, Op]]:
    """A global order of ``(stage, op)`` that keeps each stage's order and
    only submits an op after the ops it takes references from.

    F(s, mb) needs F(s-1, mb); B(s, mb) needs B(s+1, mb) and F(s, mb).
    Raises ValueError when the schedule deadlocks (no order exists).
    """
    num_stages = len(schedule)
    position = [0] * num_stages
    done: set[tuple[int, Op]] = set()
    order: list[tuple[int, Op]] = []
    total = sum(len(ops) for ops in schedule)
    while len(order) < total:
        progressed = False
        for stage in range(num_stages):
            while position[stage] < len(schedule[stage]):
                op = schedule[stage][position[stage]]
                if not all(dep in done for dep in _dependencies(stage, op, num_stages)):
                    break
                order.append((stage, op))
                done.add((stage, op))
                position[stage] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule deadlocks at positions {position}")
    return order


def _dependencies(stage: int, op: Op, num_stages: int) -> list[tuple[int, Op]]:
    if op.kind == "F":
        return [(stage - 1, op)] if stage > 0 else []
    deps = [(stage, Op("F", op.micro_batch))]
    if stage < num_stages - 1:
        deps.append((stage + 1, op))
    return deps


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle fraction of a GPipe/1F1B step with equal stage times: (p-1)/(m+p-1)."""
    _check_sizes(num_stages, num_micro_batches)
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def max_in_flight(schedule: list[list[Op]]) -> list[int]:
    """Per stage, the most micro-batches whose forward ran but backward did not."""
    peaks = []
    for ops in schedule:
        in_flight = peak = 0
        for op in ops:
            in_flight += 1 if op.kind == "F" else -1
            peak = max(peak, in_flight)
        peaks.append(peak)
    return peaks


def _check_sizes(num_stages: int, num_micro_batches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
