"""Timed run of lowered schedules: how long a step takes and how much of it each
worker idles, before any worker starts. No Ray, no torch.

The rule is the dry-run's (:mod:`raypipe.core.simulator`), with time added:

- each worker runs its ops in order; a compute op (F, B, or any kind the
  caller times) occupies the worker for its time (``op_seconds``);
- a message's transfer starts once both its send and its receive are posted
  (the rendezvous rule: nothing is buffered), and both ends complete at that
  start plus the message's time (``message_seconds``); a SEND, RECV or
  EXCHANGE blocks its worker until every message in it has completed, and the
  worker is not busy while it waits;
- a collective starts once every worker has reached it, and then takes its
  time on each worker (none by default).

Messages in flight at once do not slow each other (no link contention).

That is the slowest timing the rendezvous rule allows. The executors start a send
asynchronously and compute on, and on gloo every receive is posted ahead (see
:mod:`raypipe.comm.p2p`), so a message leaves as soon as it is sent: with
``buffered_sends=True`` a send completes as it is posted, holding neither
worker, and its message arrives its time later, when the receive (alone or in
an EXCHANGE) can complete. Which ops can run is still decided by the
rendezvous rule, the stricter one.

Nothing in this rule lets one op's times depend on an op that completes after
it in the dry-run's order (an op waits only on its own worker's earlier ops and
on the posting of the ops it exchanges messages with, which the dry-run
completes first), so the run evaluates each op once, in that order: the same
times an event-driven run gives, and the same ops that can run, with the same
:class:`~raypipe.core.simulator.ScheduleError` where none can.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Union

from raypipe.core.ops import EXCHANGE, LOOPED, OPTIMIZER_STEP, RECEIVES, REDUCE_GRAD, SENDS, LoweredOp
from raypipe.core.simulator import simulate

# The time of a compute op or a collective on a worker: ``(stage, op) -> seconds``, or a mapping
# from an op kind ("F", "B", ...) to seconds, where a ``(stage, kind)`` key overrides the kind's
# time on that stage. A mapping leaves a collective free unless it names it.
OpSeconds = Union[Callable[[int, LoweredOp], float], Mapping[Union[str, tuple[int, str]], float]]
# The time of one message: ``(sender, receiver, send op) -> seconds``, or the same for every message.
MessageSeconds = Union[Callable[[int, int, LoweredOp], float], float]

_COLLECTIVES = (REDUCE_GRAD, OPTIMIZER_STEP)


class TimedOp(NamedTuple):
    """When ``op`` ran on ``stage``: from when the stage posted it to when it
    completed (so a send's, receive's or collective's span includes its wait)."""

    stage: int
    op: LoweredOp
    start: float
    end: float


@dataclass(frozen=True)
class TimedRun:
    """The timed run of one step; per-worker tuples are indexed by stage.

    ``busy_s`` is the time each worker spends in compute ops (not in messages or
    collectives); ``bubble_fraction`` is the rest of the step, ``1 - busy/step``
    (0 for a step of no time). ``timeline`` holds every op, in the dry-run's order.
    """

    step_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    timeline: tuple[TimedOp, ...]


def simulate_timed(lowered: list[list[LoweredOp]], op_seconds: OpSeconds,
                   message_seconds: MessageSeconds = 0.0, *, buffered_sends: bool = False,
                   placement: str = LOOPED) -> TimedRun:
    """Run ``lowered`` (``lowered[stage]`` = that stage's ops, in order) with time.

    ``op_seconds`` times each compute op and collective (see :data:`OpSeconds`);
    ``message_seconds`` each message (see :data:`MessageSeconds`). Every worker
    starts at 0; the step ends when the last op of any worker completes.
    ``buffered_sends`` times messages as sent ahead of their receives (see the
    module's docstring) instead of by the rendezvous rule. ``placement`` is where
    the schedule puts its chunks (:data:`raypipe.core.schedule.PLACEMENT`); compute
    ops of any kind (F, B, I, W) on any chunk are timed by their kind.

    Raises :class:`~raypipe.core.simulator.ScheduleError` exactly where
    :func:`~raypipe.core.simulator.simulate` does, and ``ValueError`` for a
    compute op that ``op_seconds`` gives no time, or a time that is negative or
    not finite.
    """
    op_time = _op_time(op_seconds)
    message_time = _message_time(message_seconds)
    partners = _partners(lowered)
    num_stages = len(lowered)
    position = [0] * num_stages
    free_at = [0.0] * num_stages  # when each worker completed its last op: when it posts the next
    posted_at: dict[tuple[int, int], float] = {}  # (stage, index of the op in its stage) -> when posted
    busy = [0.0] * num_stages
    timeline: list[TimedOp] = []
    collectives = [0] * num_stages  # per worker, how many collectives it has run
    collective_starts: list[float] = []  # when the n-th collective started (on every worker)
    for stage, op in simulate(lowered, placement):
        index = position[stage]
        position[stage] += 1
        start = free_at[stage]
        posted_at[(stage, index)] = start
        if op.kind in _COLLECTIVES:
            # the dry-run completes a collective on every stage in a row, once all reached it:
            # when the first completes, every worker's free time is when it reached it
            collectives[stage] += 1
            if len(collective_starts) < collectives[stage]:
                collective_starts.append(max(free_at))
            end = collective_starts[collectives[stage] - 1] + op_time(stage, op)
        elif op.kind in SENDS + RECEIVES or op.kind == EXCHANGE:
            end = start
            for part, (peer, peer_index, peer_place) in zip(op.unbatched(), partners[(stage, index)]):
                # the dry-run completes an op only once the ops it exchanges messages with were
                # posted: the peer's op is this one, one it completed, or the one it goes to next
                assert peer_index <= position[peer], (stage, op, peer, peer_index)
                other_posted = posted_at.get((peer, peer_index), free_at[peer])
                if part.kind in SENDS:
                    if not buffered_sends:  # a buffered send holds nobody
                        end = max(end, max(start, other_posted) + message_time(stage, peer, part))
                    continue
                send = lowered[peer][peer_index].unbatched()[peer_place]
                transfer_start = other_posted if buffered_sends else max(start, other_posted)
                end = max(end, transfer_start + message_time(peer, stage, send))
        else:
            seconds = op_time(stage, op)
            end = start + seconds
            busy[stage] += seconds
        free_at[stage] = end
        timeline.append(TimedOp(stage, op, start, end))
    step = max(free_at, default=0.0)
    return TimedRun(step_s=step, busy_s=tuple(busy),
                    bubble_fraction=tuple((step - time) / step if step > 0 else 0.0 for time in busy),
                    timeline=tuple(timeline))


def _partners(lowered: list[list[LoweredOp]]) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """Per (stage, index of a SEND/RECV/EXCHANGE in its stage): for each of its
    messages, in order, the other end: (stage, index of its op, place in the op). Two
    stages' messages match in issue order (the dry-run has checked they do)."""
    # per (sender, receiver): each end as (stage, index of its op, place of the message in the op)
    sends: defaultdict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    receives: defaultdict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    partners: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for stage, ops in enumerate(lowered):
        for index, op in enumerate(ops):
            parts = op.unbatched()
            if op.kind == EXCHANGE or op.kind in SENDS + RECEIVES:
                partners[(stage, index)] = [(-1, -1, -1)] * len(parts)
            for place, part in enumerate(parts):
                if part.kind in SENDS:
                    sends[(stage, part.peer)].append((stage, index, place))
                elif part.kind in RECEIVES:
                    receives[(part.peer, stage)].append((stage, index, place))
    for channel, sent in sends.items():
        for (s_stage, s_index, s_place), (r_stage, r_index, r_place) in zip(sent, receives[channel]):
            partners[(s_stage, s_index)][s_place] = (r_stage, r_index, r_place)
            partners[(r_stage, r_index)][r_place] = (s_stage, s_index, s_place)
    return partners


def _op_time(op_seconds: OpSeconds) -> Callable[[int, LoweredOp], float]:
    """``op_seconds`` as a checked ``(stage, op) -> seconds``."""
    if callable(op_seconds):
        given = op_seconds
    elif isinstance(op_seconds, Mapping):
        by_key = dict(op_seconds)

        def given(stage: int, op: LoweredOp) -> float:
            for key in ((stage, op.kind), op.kind):
                if key in by_key:
                    return by_key[key]
            if op.kind in _COLLECTIVES:
                return 0.0
            raise ValueError(f"op_seconds gives no time for {op!r} on stage {stage}: add {op.kind!r} "
                             f"or ({stage}, {op.kind!r}) to it")
    else:
        raise TypeError(f"op_seconds must be a mapping from op kind to seconds or a callable (stage, op) -> "
                        f"seconds, not {type(op_seconds).__name__}")

    def checked(stage: int, op: LoweredOp) -> float:
        return _checked_seconds(given(stage, op), "op_seconds", f"{op!r} on stage {stage}")

    return checked


def _message_time(message_seconds: MessageSeconds) -> Callable[[int, int, LoweredOp], float]:
    """``message_seconds`` as a checked ``(sender, receiver, send op) -> seconds``."""
    if callable(message_seconds):
        given = message_seconds
    else:
        constant = _checked_seconds(message_seconds, "message_seconds")
        return lambda sender, receiver, op: constant

    def checked(sender: int, receiver: int, op: LoweredOp) -> float:
        return _checked_seconds(given(sender, receiver, op), "message_seconds",
                                f"{op!r} from stage {sender} to stage {receiver}")

    return checked


def _checked_seconds(seconds: object, source: str, subject: str | None = None) -> float:
    """``seconds`` as a float, refused unless a finite number >= 0; ``subject`` is what it times."""
    given = f"{source} gives {seconds!r} seconds for {subject}" if subject else f"{source} is {seconds!r} seconds"
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"{given}: a time is a number of seconds")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{given}: a time is finite and >= 0")
    return float(seconds)
