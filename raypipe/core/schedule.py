"""Pipeline schedules as pure data: per stage, the ordered ops. No Ray, no torch.

A schedule is ``list[list[Op]]``: ``schedule[stage]`` is the order in which that
stage runs its forward (F) and backward (B) ops. :mod:`raypipe.core.lowering`
adds the sends, receives and collectives; :mod:`raypipe.core.simulator` checks
the result runs (``make_schedule`` does for every schedule) and orders it for
the per-op executor, whose submission order is the schedule.
"""
from __future__ import annotations

import functools

from raypipe.core.lowering import lower
from raypipe.core.ops import LoweredOp, Op
from raypipe.core.simulator import simulate

SCHEDULES = ("gpipe", "1f1b")


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
    """The schedule called ``name`` (one of :data:`SCHEDULES`), checked by a dry-run.

    Raises :class:`~raypipe.core.simulator.ScheduleError` when the lowered
    schedule would deadlock, mis-pair messages or run F/B out of place.
    """
    if name == "gpipe":
        schedule = gpipe_schedule(num_stages, num_micro_batches)
    elif name == "1f1b":
        schedule = one_f_one_b_schedule(num_stages, num_micro_batches)
    else:
        raise ValueError(f"unknown schedule {name!r}: expected one of {SCHEDULES}")
    dry_run(schedule)
    return schedule


def dry_run(schedule: list[list[Op]]) -> tuple[tuple[int, LoweredOp], ...]:
    """The simulator's order of the lowered ``schedule`` (each stage's order kept,
    every receive after its send): the per-op executor submits in it."""
    return _dry_run(tuple(tuple(ops) for ops in schedule))


@functools.lru_cache(maxsize=256)
def _dry_run(schedule: tuple[tuple[Op, ...], ...]) -> tuple[tuple[int, LoweredOp], ...]:
    # once per distinct schedule: the memory planner builds thousands while it searches
    return tuple(simulate(lower([list(ops) for ops in schedule])))


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
