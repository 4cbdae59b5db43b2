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
- an EXCHANGE posts its batch once the headers it awaits first are in (a header
  is in when its sender reached the op that sends it: headers take no time), and
  then each receive it makes after the batch once the one before completed
  (:func:`~raypipe.core.simulator.postings`);
- a collective starts once every worker has reached it, and then takes its
  time on each worker (none by default).

Messages in flight at once do not slow each other (no link contention).

That is the slowest timing the rendezvous rule allows. The executors start a send
asynchronously and compute on, and on gloo every receive is posted ahead (see
:mod:`raypipe.comm.p2p`), so a message leaves as soon as it is sent: with
``buffered_sends=True`` a send completes as it is posted, holding neither
worker, and its message arrives its time later, when the receive (alone or in
an EXCHANGE) can complete. Which ops can run is still decided by the
rendezvous rule, the stricter one. An EXCHANGE still holds its worker until
every receive in it is in, as NCCL's batch does; on gloo the runtime leaves
each receive to the op that uses it (:class:`~raypipe.comm.step_messages.DeferredReceive`),
so for chunked schedules on gloo these timings are an upper bound.

Nothing in this rule lets a time depend on a step that comes after it in the
dry-run's steps (:func:`~raypipe.core.simulator.simulate_events`: a worker reaching
an op, posting messages, seeing them complete): a posting waits only on its own
worker's earlier steps and on its senders reaching the ops whose headers it awaits,
and a posting completes only once the other end of each of its messages was posted,
all of which the dry-run does first. So the run evaluates each step once, in that
order: the same times an event-driven run gives, and the same ops that can run,
with the same :class:`~raypipe.core.simulator.ScheduleError` where none can.
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union

from raypipe.core.collector_paused import collector_paused
from raypipe.core.ops import COLLECTIVES, EXCHANGE, HEADERS, LOOPED, RECEIVES, SENDS, LoweredOp
from raypipe.core.simulator import DONE, POSTED, REACHED, Event, postings, simulate_events

# The time of a compute op or a collective on a worker: ``(stage, op) -> seconds``, or a mapping
# from an op kind ("F", "B", ...) to seconds, where a ``(stage, kind)`` key overrides the kind's
# time on that stage. A mapping leaves a collective free unless it names it.
OpSeconds = Union[Callable[[int, LoweredOp], float], Mapping[Union[str, tuple[int, str]], float]]
# The time of one message: ``(sender, receiver, send op) -> seconds``, or the same for every message.
MessageSeconds = Union[Callable[[int, int, LoweredOp], float], float]



class TimedOp(NamedTuple):
    """When ``op`` ran on ``stage``: from when the stage posted it to when it
    completed (so a send's, receive's or collective's span includes its wait)."""

    stage: int
    op: LoweredOp
    start: float
    end: float


# TimedOp(...) without a NamedTuple constructor's keyword handling: a big pipeline's run makes many
_timed_op = functools.partial(tuple.__new__, TimedOp)


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


@collector_paused()
def simulate_timed(lowered: list[list[LoweredOp]], op_seconds: OpSeconds,
                   message_seconds: MessageSeconds = 0.0, *, buffered_sends: bool = False,
                   placement: str = LOOPED, events: Sequence[Event] | None = None,
                   boundary_shapes: str = HEADERS) -> TimedRun:
    """Run ``lowered`` (``lowered[stage]`` = that stage's ops, in order) with time.

    ``op_seconds`` times each compute op and collective (see :data:`OpSeconds`);
    ``message_seconds`` each message (see :data:`MessageSeconds`). Every worker
    starts at 0; the step ends when the last op of any worker completes.
    ``buffered_sends`` times messages as sent ahead of their receives (see the
    module's docstring) instead of by the rendezvous rule. ``placement`` is where
    the schedule puts its chunks (:data:`raypipe.core.schedule.PLACEMENT`); compute
    ops of any kind (F, B, I, W) on any chunk are timed by their kind.
    ``boundary_shapes``: ``"headers"`` (a header before every activation: every step with
    headers, and the first with learned shapes) or ``"learned"`` (the steady state once every
    signature is learned: no header awaited, every payload in its exchange's batch).
    ``events``: ``simulate_events(lowered, placement, boundary_shapes)``, where the caller already has them
    (they depend on the ops alone, not on the times: a caller timing one schedule under many
    times, as the step predictor's search does, runs the dry-run once); not checked against
    ``lowered``.

    Raises :class:`~raypipe.core.simulator.ScheduleError` exactly where
    :func:`~raypipe.core.simulator.simulate` does, and ``ValueError`` for a
    compute op that ``op_seconds`` gives no time, or a time that is negative or
    not finite.
    """
    op_time = _op_time(op_seconds)
    message_time = _message_time(message_seconds)
    num_stages = len(lowered)
    free_at = [0.0] * num_stages  # when each worker completed its last op: when it reaches the next
    now = [0.0] * num_stages  # when each worker's current op last moved on (reached, or a posting completed)
    reached_at: dict[tuple[int, int], float] = {}  # (stage, index of the op in its stage) -> when reached
    # per (sender, receiver): each end as posted, in issue order (sends, receives): (when, its part)
    channels: defaultdict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    # per stage: when its posting was posted, and its messages
    in_flight: dict[int, tuple[float, list[tuple[LoweredOp, int, int, float]]]] = {}
    busy = [0.0] * num_stages
    timeline: list[TimedOp] = []
    collectives = [0] * num_stages  # per worker, how many collectives it has run
    collective_starts: list[float] = []  # when the n-th collective started (on every worker)
    steps: dict[tuple[int, int], tuple] = {}  # postings() of each op posted, per (stage, index)
    for kind, stage, index, posting, headers_from in (simulate_events(lowered, placement, boundary_shapes)
                                                      if events is None else events):
        if kind == REACHED:
            reached_at[(stage, index)] = now[stage] = free_at[stage]
        elif kind == POSTED:
            posted = max([now[stage]] + [reached_at[source] for source in headers_from])
            messages = []
            if (stage, index) not in steps:
                steps[(stage, index)] = postings(lowered[stage][index], boundary_shapes)
            for part in steps[(stage, index)][posting].parts:
                peer, is_send = part.peer, part.kind in SENDS
                own = channels[(stage, peer) if is_send else (peer, stage)][0 if is_send else 1]
                own.append((posted, part))
                messages.append((part, peer, len(own) - 1, posted))
            in_flight[stage] = posted, messages
        elif kind == DONE:
            now[stage] = _posting_end(stage, *in_flight.pop(stage), channels, message_time, buffered_sends)
        else:
            op = lowered[stage][index]
            start = reached_at.get((stage, index), free_at[stage])
            if op.kind in COLLECTIVES:
                # the dry-run completes a collective on every stage in a row, once all reached it:
                # when the first completes, every worker's free time is when it reached it
                collectives[stage] += 1
                if len(collective_starts) < collectives[stage]:
                    collective_starts.append(max(free_at))
                end = collective_starts[collectives[stage] - 1] + op_time(stage, op)
            elif op.kind in SENDS + RECEIVES or op.kind == EXCHANGE:
                end = now[stage]
            else:
                seconds = op_time(stage, op)
                end = start + seconds
                busy[stage] += seconds
            free_at[stage] = end
            timeline.append(_timed_op((stage, op, start, end)))
    step = max(free_at, default=0.0)
    return TimedRun(step_s=step, busy_s=tuple(busy),
                    bubble_fraction=tuple((step - time) / step if step > 0 else 0.0 for time in busy),
                    timeline=tuple(timeline))


def _posting_end(stage: int, posted_at: float, messages: list[tuple[LoweredOp, int, int, float]],
                 channels: defaultdict[tuple[int, int], tuple[list, list]], message_time: Callable,
                 buffered_sends: bool) -> float:
    """When a posting of ``stage``, posted at ``posted_at``, completes: every one of its ``messages``
    (part, peer, place in its channel, when posted) has its other end posted (the dry-run completes
    it only then). A posting of no messages (an EXCHANGE's batch when every part of it is received
    after the batch) completes as it is posted."""
    end = posted_at
    for part, peer, place, posted in messages:
        if part.kind in SENDS:
            if not buffered_sends:  # a buffered send holds nobody
                other_posted, _ = channels[(stage, peer)][1][place]
                end = max(end, max(posted, other_posted) + message_time(stage, peer, part))
            continue
        other_posted, send = channels[(peer, stage)][0][place]
        transfer_start = other_posted if buffered_sends else max(posted, other_posted)
        end = max(end, transfer_start + message_time(peer, stage, send))
    return end


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
            if op.kind in COLLECTIVES:
                return 0.0
            raise ValueError(f"op_seconds gives no time for {op!r} on stage {stage}: add {op.kind!r} "
                             f"or ({stage}, {op.kind!r}) to it")
    else:
        raise TypeError(f"op_seconds must be a mapping from op kind to seconds or a callable (stage, op) -> "
                        f"seconds, not {type(op_seconds).__name__}")

    def checked(stage: int, op: LoweredOp) -> float:
        seconds = given(stage, op)
        if type(seconds) is float and 0.0 <= seconds < math.inf:  # the common case, its subject not printed
            return seconds
        return _checked_seconds(seconds, "op_seconds", f"{op!r} on stage {stage}")

    return checked


def _message_time(message_seconds: MessageSeconds) -> Callable[[int, int, LoweredOp], float]:
    """``message_seconds`` as a checked ``(sender, receiver, send op) -> seconds``."""
    if callable(message_seconds):
        given = message_seconds
    else:
        constant = _checked_seconds(message_seconds, "message_seconds")
        return lambda sender, receiver, op: constant

    def checked(sender: int, receiver: int, op: LoweredOp) -> float:
        seconds = given(sender, receiver, op)
        if type(seconds) is float and 0.0 <= seconds < math.inf:  # the common case, its subject not printed
            return seconds
        return _checked_seconds(seconds, "message_seconds", f"{op!r} from stage {sender} to stage {receiver}")

    return checked


def _checked_seconds(seconds: object, source: str, subject: str | None = None) -> float:
    """``seconds`` as a float, refused unless a finite number >= 0; ``subject`` is what it times."""
    given = f"{source} gives {seconds!r} seconds for {subject}" if subject else f"{source} is {seconds!r} seconds"
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"{given}: a time is a number of seconds")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{given}: a time is finite and >= 0")
    return float(seconds)
