"""Dry-run of lowered schedules: catch hangs and mis-paired tensors before any
worker starts. No Ray, no torch.

The model is NCCL's rendezvous rule, which binds every transport (gloo and the
object store block less, so a lowering that completes here completes there):

- each stage runs its ops in order, one at a time;
- a send completes only once its receive is posted, and a receive only once
  its send is posted: nothing is buffered (NCCL buffers no large message);
- between two stages, messages match in issue order whatever their kind (NCCL
  ignores tags): the k-th send from a to b meets b's k-th receive from a, and
  both must name the same kind and micro-batch, and the receiver's chunk must
  hold the virtual stage next to the sender's (each end names its own chunk);
- an EXCHANGE posts a batch, as ``dist.batch_isend_irecv`` does, which completes
  once every one of its messages is matched: its sends, its gradient receives and
  the payload receives of its ``header_first`` activations, whose headers it
  awaits before posting the batch (a header is in once its sender has reached the
  op that sends it: headers go over a control channel with receives posted ahead);
  then, one at a time, each other activation's payload receive (and any receive
  behind one from the same peer), its header awaited: one stream per worker runs
  its batches one after another (:func:`postings`). With ``boundary_shapes="learned"``
  (the steady state once every message key's signature is learned:
  :mod:`raypipe.comm.boundary_signatures`) no header goes, and an EXCHANGE posts all
  of its parts in its batch; the first step, and keys that keep headers, run as above;
- a collective completes only once every stage has reached it.

So a stage that sends to a peer and then receives from it, while the peer sends
first too, deadlocks here although it runs on gloo: the lowering
(:mod:`raypipe.core.lowering`) posts such pairs as one EXCHANGE. And a ring of
workers whose exchanges each send on and receive the activation behind the
batch deadlocks too: the lowering awaits such headers first.

:func:`raypipe.core.timed_simulation.simulate_timed`, which builds on this module,
runs the same rule with time: the step's length and each stage's bubble.
"""
from __future__ import annotations

import bisect
import functools
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from raypipe.core.collector_paused import collector_paused
from raypipe.core.ops import (BOUNDARY_SHAPES, COLLECTIVES, COMPUTE, EXCHANGE, HEADERS, LEARNED, LOOPED, RECEIVES,
                              RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, SENDS, LoweredOp, awaiting_header, neighbour)
from raypipe.core.schedule_checks import ScheduleError, check_schedule  # ScheduleError: re-exported

_SEND_MATCHING = {RECV_ACT: SEND_ACT, RECV_GRAD: SEND_GRAD}
_POSTING_KINDS = frozenset(SENDS + RECEIVES + (EXCHANGE,))  # the ops that post messages (postings)


def simulate(lowered: list[list[LoweredOp]], placement: str = LOOPED,
             boundary_shapes: str = HEADERS) -> list[tuple[int, LoweredOp]]:
    """Dry-run ``lowered`` (``lowered[stage]`` = that stage's ops, in order), whose
    chunks are placed on the workers by ``placement`` (see :mod:`raypipe.core.ops`), under the
    rule in this module's docstring, with a header before every activation (``boundary_shapes=
    "headers"``, and every first step) or none (``"learned"``: a step once every signature is learned).

    Returns every ``(stage, op)`` in the order it completed, a topological order
    the executor can submit in: each stage's order is kept and every receive
    (alone or in an EXCHANGE) comes after the op that made the tensor it
    receives. The order is round-robin: in each sweep, stages 0..p-1 in turn
    take their next op as far as it goes (post what it posts once its headers are
    in, and complete it once every message in it is matched); then, if every stage waits on the same collective, it runs
    on all stages, in stage order.

    Raises :class:`ScheduleError` for what :func:`~raypipe.core.schedule_checks.check_schedule`
    finds first (compute ops out of place or missing, a SEND/RECV with the wrong peer, a send
    never received or a receive never sent), a receive that would get another message than it
    names ("mismatch") and stages that all wait ("deadlock", including sends that wait on each
    other's receives).
    """
    return list(_finished_run(lowered, placement, boundary_shapes)[0])


def simulate_events(lowered: list[list[LoweredOp]], placement: str = LOOPED,
                    boundary_shapes: str = HEADERS) -> list[Event]:
    """What :func:`simulate` does, step by step (see :class:`Event`), for the timed run; the
    same checks and errors."""
    return list(_finished_run(lowered, placement, boundary_shapes)[1])


# The lowering, the timed run and the planner dry-run the same lowerings again and again (each
# candidate of an interleaved lowering in both boundary-shapes modes, then the chosen one for the
# trainer's order): the last few checks and runs are kept, keyed by the ops (a run is a pure
# function of them), errors by their message; only lowerings of at most _RECENT_OPS ops, so that
# what is kept stays small (a run's events take some hundred bytes an op).
_RECENT_RUNS, _RECENT_OPS = 16, 1 << 16
_checked: OrderedDict[tuple, int | str] = OrderedDict()  # (ops, placement) -> num_chunks, or the error
_runs: OrderedDict[tuple, tuple | str] = OrderedDict()  # (ops, placement, boundary_shapes) -> (order, events)
_MISSING = object()


def _remembered(cache: OrderedDict, key: tuple | None, compute) -> object:
    """``compute()`` (a value, or the message of a :class:`ScheduleError` it raised), kept in
    ``cache`` under ``key`` (None: not kept) among the last :data:`_RECENT_RUNS`."""
    if key is not None:
        outcome = cache.get(key, _MISSING)
        if outcome is not _MISSING:
            return outcome
    try:
        outcome = compute()
    except ScheduleError as error:
        outcome = str(error)
    if key is not None:
        _keep(cache, key, outcome)
    return outcome


def _keep(cache: OrderedDict, key: tuple, outcome: object) -> None:
    cache[key] = outcome
    while len(cache) > _RECENT_RUNS:
        try:
            cache.popitem(last=False)
        except KeyError:  # emptied meanwhile by another thread's dry-run
            break


def _frozen(lowered: list[list[LoweredOp]]) -> tuple | None:
    """``lowered`` as a hashable key, or None where it is too long to keep or an op cannot be
    hashed (left to the checks)."""
    if sum(len(ops) for ops in lowered) > _RECENT_OPS:
        return None
    key = tuple(tuple(ops) for ops in lowered)
    try:
        hash(key)
    except TypeError:
        return None
    return key


@collector_paused()
def _finished_run(lowered: list[list[LoweredOp]], placement: str,
                  boundary_shapes: str) -> tuple[tuple[tuple[int, LoweredOp], ...], tuple[Event, ...]]:
    """The checked run's (order, events); raises as :func:`simulate` says."""
    frozen = _frozen(lowered)
    num_chunks = _remembered(_checked, None if frozen is None else (frozen, placement),
                             lambda: check_schedule(lowered, placement))
    if isinstance(num_chunks, str):
        raise ScheduleError(num_chunks)
    if boundary_shapes not in BOUNDARY_SHAPES:
        raise ValueError(f"boundary_shapes={boundary_shapes!r}: expected one of {', '.join(BOUNDARY_SHAPES)}")

    def finish() -> tuple[tuple[tuple[int, LoweredOp], ...], tuple[Event, ...]]:
        run = _Run(lowered, placement, num_chunks, boundary_shapes)
        while not run.finished():
            if not run.sweep():
                raise ScheduleError(run.deadlock_message())
        return tuple(run.order), tuple(run.events)

    outcome = _remembered(_runs, None if frozen is None else (frozen, placement, boundary_shapes), finish)
    if isinstance(outcome, str):
        raise ScheduleError(outcome)
    return outcome


class DraftRun(NamedTuple):
    """A dry-run of a draft lowering, for the lowering (see :func:`run_draft`)."""

    lowered: list[list[LoweredOp]]  # the draft, with the payloads awaited first that changed nothing before
    late_payloads: list[tuple[int, int, LoweredOp]]  # payloads behind stuck batches, headers in too late
    stuck_sends: list[tuple[int, LoweredOp]]  # sends waiting for a receive never posted
    run: _Run | None = None  # the run itself, which the next draft's run may go on from (run_draft's after)


def run_draft(lowered: list[list[LoweredOp]], placement: str = LOOPED, num_chunks: int = 1,
              after: DraftRun | None = None) -> DraftRun:
    """Dry-run ``lowered`` (no checks), receiving in its exchange's batch each activation's
    payload found behind a stuck batch, where that changes nothing that happened before:
    its header was in when the batch was posted, so awaiting it first (``header_first``)
    would have posted the batch at the same point. Where the run still gets stuck, says
    each ``(stage, index of its EXCHANGE, RECV_ACT part)`` of a payload behind a stuck
    batch whose header came in only after the batch was posted (awaiting it first changes
    what ran before: a dry-run from the start must judge), and each ``(stage, send)`` of a
    send (alone or in an EXCHANGE) that waits for a receive not posted; neither if the
    run completes.

    ``after``: an earlier draft run, with the same ``placement`` and ``num_chunks``, of a
    lowering that differs from ``lowered`` only in the headers some EXCHANGEs await first (the
    lowering's next draft: more awaited). Two dry-runs are the same until a stage takes an op
    where they differ, so this one goes on from the last sweep before that point of that run
    (which becomes this one) instead of from the start: the same run, without the part both
    share (the lowering's drafts of a long pipeline are each stuck further on). Any other
    ``after`` is run from the start."""
    run = after.run if after is not None else None
    if run is None or (run.placement, run.num_chunks) != (placement, num_chunks) or not run.rewind(lowered):
        run = _Run([list(ops) for ops in lowered], placement, num_chunks, rewindable=True)
    amended = False
    while not run.finished():
        progressed = run.sweep()
        run.checkpoint()
        if progressed:
            continue
        stuck = run.payloads_behind_stuck_batches()
        in_time = [(stage, index, part) for stage, index, part in stuck if part in run.headers_in_at_batch[stage]]
        if not in_time:
            sends = [(stage, part) for stage in range(len(lowered))
                     if (op := run.next_op(stage)) is not None and op.kind not in COLLECTIVES
                     for part in run.unmatched(stage) if part.kind in SENDS]
            return DraftRun(run.lowered, stuck, sends, run)
        for stage, _, part in in_time:
            run.await_in_batch(stage, part)
        amended = True
    frozen = _frozen(run.lowered)
    if not amended and frozen is not None and num_chunks == 1 + max(
            (op.chunk for ops in frozen for op in ops if op.kind in COMPUTE), default=0):
        # the checked dry-run of this lowering, run from the start as this one was: the lowering times it next
        _keep(_runs, (frozen, placement, HEADERS), (tuple(run.order), tuple(run.events)))
    return DraftRun(run.lowered, [], [], run)


@dataclass
class _Channel:
    """The messages from one stage to another, in the order each side posted them."""

    sends: list[LoweredOp] = field(default_factory=list)
    receives: list[LoweredOp] = field(default_factory=list)


class Posting(NamedTuple):
    """Messages a stage posts together (one ``batch_isend_irecv``), once the headers of
    ``headers`` (RECV_ACT parts) are in; the posting completes once every one of ``parts`` is matched."""

    headers: tuple[LoweredOp, ...]
    parts: tuple[LoweredOp, ...]


def postings(op: LoweredOp, boundary_shapes: str = HEADERS) -> tuple[Posting, ...]:
    """What ``op`` posts, one posting after another (each once the one before completed):
    none for a compute op or a collective, its one message for a SEND or RECV, and for an
    EXCHANGE its batch and then, one at a time, each receive the channel makes after it;
    with ``boundary_shapes="learned"`` an EXCHANGE's batch holds every part, no header
    awaited (every activation's signature is known: nothing is received after the batch).

    The batch holds every send, each RECV_ACT part in ``header_first`` (its header awaited
    before the batch is posted) and each RECV_GRAD part; a receive behind a RECV_ACT part
    from the same peer that is received after the batch comes after it too (a pair's
    messages are issued in part order on both ends). A lone RECV_ACT awaits its header
    too, but that changes nothing here: its payload's send is posted with the header."""
    if op.kind not in _POSTING_KINDS:  # half a pipeline's ops: asked of every run, never cached
        return ()
    return _postings(op, boundary_shapes)


@functools.lru_cache(maxsize=1 << 17)
def _postings(op: LoweredOp, boundary_shapes: str) -> tuple[Posting, ...]:
    # every dry-run asks for every message op's, and the same ops recur in every candidate lowering
    # and every run of one. The planner's search dry-runs pipelines of ~10^5 message ops (64 workers
    # x 2 chunks x 256 micro-batches) several times each: a cache smaller than one of them misses
    # on every op of the next run (the 405B at 16,384 GPUs: 932,640 misses with 2^14 entries,
    # 129,398 with 2^17, its search's CPU 20-26% less, ~25 MB more at most)
    if op.kind in SENDS + RECEIVES:
        return (Posting((), (op,)),)
    # an EXCHANGE (postings() answers every other kind, which posts nothing, itself)
    if boundary_shapes == LEARNED:
        return (Posting((), op.parts),)
    batch, after, behind = [], [], set()
    for part in op.parts:
        received_after = part.kind in RECEIVES and (
            part.peer in behind or (part.kind == RECV_ACT and part not in op.header_first))
        if received_after:
            behind.add(part.peer)
            after.append(Posting((part,) if part.kind == RECV_ACT else (), (part,)))
        else:
            batch.append(part)
    return (Posting(op.header_first, tuple(batch)),) + tuple(after)


# What the dry-run records, in order: a stage reached an op (its SEND_ACT headers go out), posted
# one of its postings, saw one complete, or completed the op.
REACHED, POSTED, DONE, COMPLETED = "reached", "posted", "done", "completed"


class Event(NamedTuple):
    """One step of a dry-run: ``kind`` (:data:`REACHED`, :data:`POSTED`, :data:`DONE` or
    :data:`COMPLETED`) of op ``index`` of ``stage``; ``posting`` is the place of the posting
    in :func:`postings` (POSTED, DONE); ``headers_from`` the (stage, index) of each op whose
    reaching made this posting's headers available (POSTED)."""

    kind: str
    stage: int
    index: int
    posting: int = 0
    headers_from: tuple[tuple[int, int], ...] = ()


# Event(...) without the keyword handling of a NamedTuple's constructor: the dry-run makes millions
_event = functools.partial(tuple.__new__, Event)


# A rewindable run keeps its state at the end of every this many sweeps: a rewind goes back to the
# last one kept before where it must (a few sweeps run again), and a run that is never rewound, as
# most drafts are, copies its state a few times in a long run instead of at every sweep
_SWEEPS_KEPT = 8


class _Run:
    """The state of a dry-run: where each stage is and what it has posted."""

    def __init__(self, lowered: list[list[LoweredOp]], placement: str = LOOPED, num_chunks: int = 1,
                 boundary_shapes: str = HEADERS, rewindable: bool = False) -> None:
        self.lowered = lowered
        self.boundary_shapes = boundary_shapes
        self.placement, self.num_chunks = placement, num_chunks
        self.position = [0] * len(lowered)
        self.reached = [False] * len(lowered)  # whether each stage has reached its next op
        self.postings = [[postings(op, boundary_shapes) for op in ops] for ops in lowered]
        self.posting = [0] * len(lowered)  # per stage, the place of its current posting in its op's
        self.channels: defaultdict[tuple[int, int], _Channel] = defaultdict(_Channel)  # (sender, receiver)
        # per stage, the messages its current posting posted: (its place in the channel's list, the other
        # side's list, which holds its match once longer than that place), None until posted
        self.posted: list[list[tuple[int, list[LoweredOp], LoweredOp]] | None] = [None] * len(lowered)
        # where each SEND_ACT is: its header goes out once its stage reaches that op
        self.header_sources: dict[tuple[int, LoweredOp], tuple[int, int] | None] = {}  # see header_source
        self.sent_at = {(stage, part): index for stage, ops in enumerate(lowered)
                        for index, op in enumerate(ops) for part in op.unbatched() if part.kind == SEND_ACT}
        # per stage, the RECV_ACT parts received after its current batch whose headers were in as it posted it
        self.headers_in_at_batch: list[set[LoweredOp]] = [set() for _ in lowered]
        self.order: list[tuple[int, LoweredOp]] = []
        self.events: list[Event] = []
        self.total = sum(len(ops) for ops in lowered)
        # per stage, whether its next op may go further than when it last stopped: a stage waits on
        # headers (their senders reaching ops) and on matches (peers posting), so only a peer's
        # reaching or posting wakes it; a sweep skips the others, which would do nothing
        self.awake = [True] * len(lowered)
        self.targets: dict[tuple[int, int, str], tuple[int, int] | None] = {}  # neighbour(), per (stage, chunk, kind)
        self.sweeps = 0  # sweeps begun
        # rewindable (run_draft's runs): per stage, per op taken so far, the sweep at whose end it became
        # the stage's next op (0: before any; a sweep takes a stage's next op once at most, so the op is
        # first taken in a later one); the lowering it started from; every part posted on a channel in
        # order (the channels' lists only grow); and the state at the end of every few sweeps
        self.rewindable = rewindable
        self.current_since: list[list[int]] = [[0] for _ in lowered]
        self.start = tuple(tuple(ops) for ops in lowered) if rewindable else ()
        self.appended: list[list[LoweredOp]] = []  # the channel list each posted part went on, in order
        self.checkpoints: list[tuple] = []
        if rewindable:
            self.checkpoint()

    def next_op(self, stage: int) -> LoweredOp | None:
        ops = self.lowered[stage]
        return ops[self.position[stage]] if self.position[stage] < len(ops) else None

    def finished(self) -> bool:
        return len(self.order) == self.total

    def checkpoint(self) -> None:
        """Keep the state at the end of this sweep, every :data:`_SWEEPS_KEPT`-th (a rewindable
        run's; nothing otherwise)."""
        if self.rewindable and self.sweeps % _SWEEPS_KEPT == 0:
            self.checkpoints.append((self.sweeps, len(self.order), len(self.events), len(self.appended),
                                     list(self.position), list(self.reached), list(self.posting), list(self.posted),
                                     list(self.awake), list(self.headers_in_at_batch)))

    def rewind(self, lowered: list[list[LoweredOp]]) -> bool:
        """Make this run the run of ``lowered`` so far: go back to the end of the last sweep
        before any stage took an op where ``lowered`` differs from what this run started from,
        and take ``lowered``'s ops from there. Only where those ops are EXCHANGEs that differ
        in the headers they await first (the same parts: every message and every header's
        source stays where it was); False, changing nothing, otherwise."""
        start = self.start
        if not self.rewindable or len(lowered) != len(start):
            return False
        changed = []
        for stage, (ops, started, held) in enumerate(zip(lowered, start, self.lowered)):
            if len(ops) != len(started):
                return False
            for index, (op, was, now) in enumerate(zip(ops, started, held)):
                # an op this run changed as it went (await_in_batch) counts as changed too, whatever
                # ``lowered`` holds there: the state after it holds the change
                if (op is not was and op != was) or now is not was:
                    if op.kind != EXCHANGE or was.kind != EXCHANGE or op.parts != was.parts:
                        return False
                    changed.append((stage, index))
        taken = [self.current_since[stage][index] for stage, index in changed
                 if index < len(self.current_since[stage])]
        sweep = min(taken, default=self.sweeps)
        place = bisect.bisect_right(self.checkpoints, sweep, key=lambda kept: kept[0]) - 1
        (self.sweeps, orders, events, appended, position, reached, posting, posted, awake,
         headers_in) = self.checkpoints[place]
        del self.checkpoints[place + 1:]
        del self.order[orders:], self.events[events:]
        while len(self.appended) > appended:  # each part posted since, off its channel's list
            self.appended.pop().pop()
        self.position, self.reached, self.posting = list(position), list(reached), list(posting)
        self.posted, self.awake, self.headers_in_at_batch = list(posted), list(awake), list(headers_in)
        for stage, since in enumerate(self.current_since):
            del since[self.position[stage] + 1:]
        self.lowered = [list(ops) for ops in lowered]
        for stage, index in changed:
            self.postings[stage][index] = postings(self.lowered[stage][index], self.boundary_shapes)
        self.start = tuple(tuple(ops) for ops in lowered)
        return True

    def sweep(self) -> bool:
        """One round-robin sweep; False when nothing could run."""
        self.sweeps += 1
        progressed = False
        awake, lowered, position, events = self.awake, self.lowered, self.position, self.events
        for stage in range(len(lowered)):
            if not awake[stage]:
                continue
            ops = lowered[stage]
            index = position[stage]
            if index >= len(ops):
                continue
            op = ops[index]
            if op.kind in COLLECTIVES:
                continue
            if not self.postings[stage][index]:  # a compute op: _advance reaches and completes it at once
                events.append(_event((REACHED, stage, index, 0, ())))
                self._complete(stage, op)
                progressed = True
            elif self._advance(stage, op):
                progressed = True
            else:
                awake[stage] = False
        if self._collective_ready():
            for stage in range(len(lowered)):
                self._complete(stage, self.next_op(stage))
            self._wake(range(len(lowered)))
            progressed = True
        return progressed

    def _wake(self, stages) -> None:
        """Let the next sweeps take ``stages`` (of any numbers: a bad peer is left to the checks) again."""
        awake = self.awake
        for stage in stages:
            if stage is not None and 0 <= stage < len(awake):
                awake[stage] = True

    def _advance(self, stage: int, op: LoweredOp) -> bool:
        """Take ``op`` of ``stage`` as far as it goes: post its postings one after another, each
        once its headers are in and the one before completed; complete it after the last."""
        index = self.position[stage]
        progressed = not self.reached[stage]
        events = self.events
        if progressed:
            self.reached[stage] = True
            events.append(_event((REACHED, stage, index, 0, ())))
            if op.kind == SEND_ACT or op.kind == EXCHANGE:  # its headers are in
                self._wake(part.peer for part in op.unbatched() if part.kind == SEND_ACT)
        steps = self.postings[stage][index]
        posting = self.posting
        while posting[stage] < len(steps):
            step = steps[posting[stage]]
            if self.posted[stage] is None:
                sources = tuple(self.header_source(stage, part) for part in step.headers)
                if not all(source is not None and self._has_reached(*source) for source in sources):
                    return progressed
                self._post(stage, step.parts)
                events.append(_event((POSTED, stage, index, posting[stage], sources)))
                if posting[stage] == 0 and len(steps) > 1:
                    self.headers_in_at_batch[stage] = {
                        part for later in steps[1:] for part in later.headers
                        if (source := self.header_source(stage, part)) is not None and self._has_reached(*source)}
                progressed = True
            for place, other, _ in self.posted[stage]:
                if place >= len(other):  # a part not matched yet
                    return progressed
            events.append(_event((DONE, stage, index, posting[stage], ())))
            posting[stage] += 1
            self.posted[stage] = None
        self._complete(stage, op)
        return True

    def header_source(self, stage: int, receive: LoweredOp) -> tuple[int, int] | None:
        """The (stage, index) of the op that sends the activation ``receive`` (a RECV_ACT of
        ``stage``) receives, whose reaching sends its header; None if no stage sends it."""
        if (stage, receive) not in self.header_sources:
            self.header_sources[(stage, receive)] = self._find_header_source(stage, receive)
        return self.header_sources[(stage, receive)]

    def _find_header_source(self, stage: int, receive: LoweredOp) -> tuple[int, int] | None:
        other = neighbour(stage, receive.chunk, RECV_ACT, len(self.lowered), self.num_chunks, self.placement)
        if other is None:
            return None
        send = LoweredOp(SEND_ACT, receive.micro_batch, stage, chunk=other[1])
        index = self.sent_at.get((receive.peer, send))
        return None if index is None else (receive.peer, index)

    def _has_reached(self, stage: int, index: int) -> bool:
        return self.position[stage] > index or (self.position[stage] == index and self.reached[stage])

    def _collective_ready(self) -> bool:
        # Collectives of a kind always run on all stages together, so reaching
        # the same kind also means reaching the same count of it.
        first = self.next_op(0)
        if first is None or first.kind not in COLLECTIVES:
            return False
        others = (self.next_op(stage) for stage in range(1, len(self.lowered)))
        return all(op is not None and op.kind == first.kind for op in others)

    def _post(self, stage: int, parts: tuple[LoweredOp, ...]) -> None:
        """Post the sends and receives ``parts``, checking each message that now has both ends."""
        posted = []
        channels = self.channels
        for part in parts:
            if part.kind in SENDS:
                channel = channels[(stage, part.peer)]
                own, other = channel.sends, channel.receives
            else:
                channel = channels[(part.peer, stage)]
                own, other = channel.receives, channel.sends
            own.append(part)
            if self.rewindable:
                self.appended.append(own)
            place = len(own) - 1
            if place < len(other):  # both ends posted: the message is matched
                if part.kind in SENDS:
                    self._check_match(part, other[place], stage, part.peer)
                else:
                    self._check_match(other[place], part, part.peer, stage)
            posted.append((place, other, part))
        self.posted[stage] = posted
        awake = self.awake
        for part in parts:  # each peer may now have its part matched
            if part.peer is not None and 0 <= part.peer < len(awake):
                awake[part.peer] = True

    def _check_match(self, send: LoweredOp, recv: LoweredOp, sender: int, receiver: int) -> None:
        # each end names its own chunk: the send's chunk's neighbour must be the receive's chunk
        key = (sender, send.chunk, send.kind)
        if key not in self.targets:
            self.targets[key] = neighbour(sender, send.chunk, send.kind, len(self.lowered), self.num_chunks,
                                          self.placement)
        target = self.targets[key]
        if (send.kind == _SEND_MATCHING[recv.kind] and send.micro_batch == recv.micro_batch
                and target == (receiver, recv.chunk)):
            return
        if send.kind != _SEND_MATCHING[recv.kind]:
            detail = f"a {send.kind}, not a {_SEND_MATCHING[recv.kind]}"
        elif send.micro_batch != recv.micro_batch:
            detail = f"micro-batch {send.micro_batch}, not {recv.micro_batch}"
        else:
            detail = f"for chunk {target[1] if target else None}, not chunk {recv.chunk}"
        # NCCL pairs point-to-point ops in issue order: this would hand over the wrong tensor.
        raise ScheduleError(f"mismatch: stage {receiver} runs {recv!r} but the message it meets, stage {sender}'s "
                            f"next in issue order, is {send!r} ({detail})")

    def unmatched(self, stage: int) -> list[LoweredOp]:
        """The parts of ``stage``'s posted batch not yet matched by a peer."""
        return [part for place, other, part in self.posted[stage] or () if place >= len(other)]

    def _complete(self, stage: int, op: LoweredOp) -> None:
        self.order.append((stage, op))
        self.events.append(_event((COMPLETED, stage, self.position[stage], 0, ())))
        self.position[stage] += 1
        if self.rewindable:
            self.current_since[stage].append(self.sweeps)
        self.reached[stage], self.posting[stage], self.posted[stage] = False, 0, None

    def waiting_on(self, stage: int) -> str:
        """What ``stage``, stuck on its next op (not a collective), waits for, as a deadlock message says it."""
        op = self.next_op(stage)
        steps = self.postings[stage][self.position[stage]]
        if op.kind != EXCHANGE:
            return ""
        step, after_batch = steps[self.posting[stage]], self.posting[stage] > 0
        if self.posted[stage] is None:
            when = "received after its batch" if after_batch else "before its batch"
            return f" (on the header of {'+'.join(map(repr, step.headers))}, {when})"
        waiting = "+".join(map(repr, self.unmatched(stage)))
        later = [part for step in steps[self.posting[stage] + 1:] for part in step.parts]
        if after_batch:
            return f" (on {waiting}, received after its batch)"
        if later:
            return f" (on {waiting}, then {'+'.join(map(repr, later))} after its batch)"
        return f" (on {waiting})" if len(self.unmatched(stage)) < len(op.parts) else ""

    def await_in_batch(self, stage: int, receive: LoweredOp) -> None:
        """Make ``stage``'s current EXCHANGE, whose batch is posted, await the header of its RECV_ACT
        part ``receive`` (and of the earlier ones from that peer) and receive the payloads in its batch,
        as if it always had: the batch's new receives are posted now, after those posted with it from
        the same peer, as they come in part order (see :func:`postings`)."""
        index = self.position[stage]
        changed = awaiting_header(self.lowered[stage][index], receive)
        self.lowered[stage][index] = changed
        self.postings[stage][index] = postings(changed)
        posted = self.posted[stage]
        already = [part for _, _, part in posted]
        self._post(stage, tuple(part for part in self.postings[stage][index][0].parts if part not in already))
        self.posted[stage] = posted + self.posted[stage]
        self._wake([stage])

    def payloads_behind_stuck_batches(self) -> list[tuple[int, int, LoweredOp]]:
        """Of a run that cannot go on: each ``(stage, index of its EXCHANGE, RECV_ACT part)`` of an
        activation that exchange receives after its batch, which waits on messages not matched,
        while the activation's header is in (its sender reached the op that sends it, which may
        wait on this payload)."""
        found = []
        for stage in range(len(self.lowered)):
            op = self.next_op(stage)
            if op is None or op.kind != EXCHANGE or self.posting[stage] > 0 or self.posted[stage] is None:
                continue
            for step in self.postings[stage][self.position[stage]][1:]:
                for part in step.headers:
                    source = self.header_source(stage, part)
                    if source is not None and self._has_reached(*source):
                        found.append((stage, self.position[stage], part))
        return found

    def deadlock_message(self) -> str:
        states, sends_wait, after_batch = [], False, False
        for stage in range(len(self.lowered)):
            op = self.next_op(stage)
            if op is None:
                states.append(f"stage {stage} has finished")
                continue
            if op.kind not in COLLECTIVES:
                sends_wait = sends_wait or any(part.kind in SENDS for part in self.unmatched(stage))
                after_batch = after_batch or any(len(step.parts) < len(op.parts) for step in
                                                 self.postings[stage][self.position[stage]][:1])
            states.append(f"stage {stage} waits on {op!r}" + (self.waiting_on(stage)
                                                                 if op.kind not in COLLECTIVES else ""))
        hint = ""
        if sends_wait:
            hint = (" (a send completes only once its receive is posted: a stage that sends to a peer and then "
                    "receives from it must post both in one EXCHANGE when the peer sends first too")
            if after_batch:
                hint += ("; an activation's payload received after its exchange's batch is posted only once the "
                         "batch completed: await its header first (<=) to receive it in the batch")
            hint += ")"
        return "deadlock: " + "; ".join(states) + hint


def __getattr__(name: str) -> object:
    # The timed run builds on this module, not the other way (docs/architecture.md, "Layer order").
    if name in ("simulate_timed", "TimedRun", "TimedOp"):
        raise ImportError(f"raypipe.core.simulator.{name} is now raypipe.core.timed_simulation.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
