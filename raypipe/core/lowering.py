"""Lower a compute-only schedule into per-stage ops with explicit communication.

A schedule says only in which order each worker runs F and B (or I and W) of
each micro-batch and model chunk; the executor also
needs to know when activations and gradients cross stage boundaries. Like
``torch.distributed.pipelining``'s ``_add_send_recv``, :func:`lower` puts a
receive right before each compute op that needs a neighbour's tensor and a send
right after each compute op whose output a neighbour needs, then closes every
stage with the step's collectives. No Ray, no torch.

A send completes only once its receive is posted (NCCL's rendezvous rule, see
:mod:`raypipe.core.simulator`), and two ranks' messages match in issue order.
So where a stage sends to a peer and then, before computing again, receives
from the same peer, while the peer does the same the other way (1F1B's steady
state: ``SEND_ACT a1`` then ``RECV_GRAD g0`` on one side, ``SEND_GRAD g0`` then
``RECV_ACT a1`` on the other), issuing them one by one leaves both sends
waiting forever. The lowering posts such a run of sends and receives as one
EXCHANGE instead (as Megatron-Core's ``send_forward_recv_backward`` does with
``batch_isend_irecv``): its sends are posted at once with its receives, so neither
side's send waits behind its own receive. An activation's payload is the exception:
it can be received only once its header gave its shape, so an EXCHANGE receives it
after the batch unless the lowering awaits its header first (``header_first``),
which a ring of chunked workers needs (:func:`_await_headers`).

Completing is not enough: a send that waits for its receive holds its worker too.
Interleaved 1F1B's workers alternate F and B; where one hands an activation on or
takes a gradient in between the two, its neighbour, in the middle of its own F or B,
has not posted the other end, and one of them waits (placed as for a split backward
below, at p = 8, m = 16, v = 2 the step took 19% longer than the schedule's, longer
than 1F1B's). So, as Megatron-Core's ``send_forward_backward_recv_forward_backward``,
such a worker receives the inputs of an F and of the B after it before the F and
sends both outputs after the B (:func:`_forward_backward_pairs`): neighbours then
post at the same instants and, with messages that take no time, the step is the
schedule's own, what buffered sends would give.
"""
from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

from raypipe.core.collector_paused import collector_paused
from raypipe.core.ops import (COMPUTE, HEADERS, LEARNED, LOOPED, OPTIMIZER_STEP, RECEIVES, RECV_ACT, RECV_GRAD,
                              REDUCE_GRAD, SEND_ACT, SEND_GRAD, SENDS, B, F, I, LoweredOp, Op, W, awaiting_header,
                              exchange, neighbour)
from raypipe.core.receive_order import EVEN_COST, receives_in_send_order
from raypipe.core.simulator import DraftRun, ScheduleError, run_draft  # the dry-run's rule, run on the drafts
from raypipe.core.timed_simulation import simulate_timed

# Per compute kind: the receive of its input and the send of its output (W needs and makes
# nothing another worker has: it only adds to this worker's weight gradients).
_COMMUNICATION = {F: (RECV_ACT, SEND_ACT), B: (RECV_GRAD, SEND_GRAD), I: (RECV_GRAD, SEND_GRAD)}
_MESSAGES = frozenset(SENDS + RECEIVES)
# LoweredOp(...) from all six fields, without a NamedTuple constructor's keyword handling: a big
# pipeline's lowering makes millions
_lowered_op = functools.partial(tuple.__new__, LoweredOp)


def lower(schedule: list[list[Op]], placement: str = LOOPED) -> list[list[LoweredOp]]:
    """Per worker, its compute ops with the sends, receives and collectives they imply.

    Worker s's chunk c is virtual stage ``virtual_stage(s, c, p, placement)`` of
    the ``p * v`` (see :mod:`raypipe.core.ops`; with one chunk per worker, stage s).
    Before F(mb) of a virtual stage > 0: RECV_ACT(mb) from the worker holding the
    previous virtual stage; after F(mb) of any but the last: SEND_ACT(mb) to the
    worker holding the next. Before B(mb) or I(mb) of any but the last virtual
    stage: RECV_GRAD(mb) from the next one's worker; after B(mb) or I(mb) of a
    virtual stage > 0: SEND_GRAD(mb) to the previous one's worker. Where the
    neighbouring virtual stage is on the same worker (ZBV's turn on the last
    worker, or every chunk of a one-worker pipeline) there is no message: the
    other chunk's compute op uses the tensor directly. W has no message. Every
    SEND/RECV names its own worker's chunk, so the two ends of a message may name
    different chunks (the last worker's chunk c sends to the first worker's chunk
    c + 1 when interleaved).

    With one chunk per worker and whole backwards (gpipe, 1f1b) each run of sends
    and receives between two compute ops that both sends to and receives from one
    peer becomes one EXCHANGE of the run, in order, and the rest go alone. With
    several chunks or a split backward (I, W), one pair of workers may carry
    activations and gradients both ways, messages match in issue order whatever they
    are (NCCL ignores tags), and interleaving sends round a ring of workers; so:

    1. with a split backward (zb_h1, zbv), each receive is posted where a run of
       even-cost ops (F = I = W, B = 2) would have its message, at the latest right
       before the op that needs it, and in its sender's order
       (:func:`~raypipe.core.receive_order.receives_in_send_order`), so it rarely waits; with whole backwards
       and chunks (interleaved_1f1b), each receive right before its op and each send
       right after it, but for an F and the B right after it that run as one pair
       (Megatron's steady state, :func:`_forward_backward_pairs`): both receives
       before the F, both sends after the B (there every worker runs its forwards,
       and its backwards, in one order of micro-batches and chunks, so receives come
       in their senders' order too, as the dry-run checks); where the rendezvous then
       costs a step longer than buffered sends, or deadlocks (rounds longer than p),
       each receive posted near when its message is sent instead, with or without the
       pairs, whichever step is shortest at even costs (:func:`_interleaved`);
    2. every run of two or more messages between compute ops is one EXCHANGE (as
       Megatron's ``send_forward_recv_forward`` posts a send to the next worker with
       a receive from the previous one);
    3. a send that the dry-run still finds waiting forever is moved after its
       worker's next compute op (:func:`_defer_waiting_sends`);
    4. each activation an EXCHANGE receives has its payload received after the batch,
       or in it, its header awaited first, where the dry-run finds the batch stuck
       without it (:func:`_await_headers`: a ring of workers each sending on).

    One lowering serves both ``boundary_shapes``: ``header_first`` is chosen for the steps
    that send headers (every step with ``"headers"``; the first with ``"learned"``, and any
    key marked dynamic), and a step whose signatures are learned sends none, so each
    EXCHANGE receives every payload in its batch (:func:`raypipe.core.simulator.postings`):
    that posts every receive no later, in the same order per peer, and the dry-run of each
    lowering completes both ways (tests/core/test_header_first.py).

        After the last op of every worker: REDUCE_GRAD, then OPTIMIZER_STEP.

    Pure, so each distinct schedule is lowered once (the dry-run, the trainer and the
    planner's searches ask again for the same ones); each call gets lists of its own.
    """
    return [list(ops) for ops in _lower_once(tuple(tuple(ops) for ops in schedule), placement)]


@functools.lru_cache(maxsize=256)
@collector_paused()
def _lower_once(schedule: tuple[tuple[Op, ...], ...], placement: str) -> tuple[tuple[LoweredOp, ...], ...]:
    return tuple(tuple(ops) for ops in _lower([list(ops) for ops in schedule], placement))


def _lower(schedule: list[list[Op]], placement: str) -> list[list[LoweredOp]]:
    num_stages = len(schedule)
    num_chunks = _num_chunks(op for ops in schedule for op in ops)
    split_backward = any(op.kind in (I, W) for ops in schedule for op in ops)
    if num_chunks == 1 and not split_backward:
        return [_batch_exchanges(_communicating(stage, ops, num_stages, placement, num_chunks))
                + [LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)] for stage, ops in enumerate(schedule)]
    if split_backward:
        alone = [_communicating(stage, ops, num_stages, placement, num_chunks) for stage, ops in enumerate(schedule)]
        alone = receives_in_send_order(alone, num_stages, num_chunks, placement)
    else:
        return _interleaved(schedule, num_stages, num_chunks, placement)
    return _defer_waiting_sends(alone, placement, num_chunks)


def _interleaved(schedule: list[list[Op]], num_stages: int, num_chunks: int, placement: str) -> list[list[LoweredOp]]:
    """The lowering of a schedule with chunks and whole backwards (interleaved_1f1b): the
    pairs' (:func:`_forward_backward_pairs`), each receive right before its op, where that
    completes and the rendezvous costs it nothing (its step at even costs, :data:`EVEN_COST`,
    is the step with buffered sends), as with rounds of p micro-batches; else the one of
    three that completes with the shortest step at even costs (steady state, then first
    step; the first of equals): that one, the pairs with each receive posted near when its
    message is sent (:func:`~raypipe.core.receive_order.receives_in_send_order`), and each
    op's messages alone, so posted.

    With rounds of q > p micro-batches (torch's order for p < m < 2p, and for m >= 2p not a
    multiple of p, such as m = 10 at p = 4) an activation reaches the wrap from the last
    worker to the first q - p ops before the first worker takes it: received right before
    its F, the last worker's send waits that long under the rendezvous rule, and with
    several rounds the first worker's pairs wait on gradients the last worker sends only
    after it, which deadlocks. Received when it is sent, it waits for nothing: at p = 4,
    v = 2 (F = 1, B = 2 a stage) m = 6, 7 and 10 take 22.5, 25.5 and 34.5 units, the
    schedule's own (the pairs alone: 34.5, 57 and a deadlock)."""
    pairs = _forward_backward_pairs(schedule, num_stages, num_chunks, placement)
    paired = [_communicating(stage, ops, num_stages, placement, num_chunks, pairs[stage])
              for stage, ops in enumerate(schedule)]
    lowered = _defer_waiting_sends(paired, placement, num_chunks)
    steps = _even_cost_steps(lowered, placement, modes=(LEARNED,))
    if steps is not None and steps[0] <= simulate_timed(lowered, EVEN_COST, buffered_sends=True,
                                                        placement=placement).step_s:
        return lowered
    if steps is not None:  # the steady state's step is timed: the first step's is left
        first_step = _even_cost_steps(lowered, placement, modes=(HEADERS,))
        steps = None if first_step is None else steps + first_step
    alone = [_communicating(stage, ops, num_stages, placement, num_chunks) for stage, ops in enumerate(schedule)]
    candidates = [(steps, lowered)]
    for drafted in (paired, alone):
        candidate = _defer_waiting_sends(receives_in_send_order(drafted, num_stages, num_chunks, placement),
                                         placement, num_chunks)
        candidates.append((_even_cost_steps(candidate, placement), candidate))
    finished = [(steps, candidate) for steps, candidate in candidates if steps is not None]
    # none finishing is left for the dry-run to report, on the pairs' lowering
    return min(finished, key=lambda finished_candidate: finished_candidate[0])[1] if finished else lowered


def _even_cost_steps(lowered: list[list[LoweredOp]], placement: str,
                     modes: tuple[str, ...] = (LEARNED, HEADERS)) -> tuple[float, ...] | None:
    """The step of ``lowered`` at even costs (:data:`EVEN_COST`) under the rendezvous rule, per
    boundary-shapes mode of ``modes``: by default with learned shapes (the steady state), then with
    headers (the first step); None if a dry-run fails."""
    try:
        return tuple(simulate_timed(lowered, EVEN_COST, placement=placement, boundary_shapes=mode).step_s
                     for mode in modes)
    except ScheduleError:
        return None


def _closed(alone: list[list[LoweredOp]], placement: str, num_chunks: int) -> DraftRun:
    """``alone`` with every run of messages one EXCHANGE, each activation's payload received in or
    after its exchange's batch as :func:`_await_headers` chooses, and the collectives at the end;
    with the sends its dry-run finds waiting."""
    lowered = [_batch_exchanges(ops, every_run=True) + [LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)]
               for ops in alone]
    return _await_headers(lowered, placement, num_chunks)


def _await_headers(lowered: list[list[LoweredOp]], placement: str, num_chunks: int) -> DraftRun:
    """``lowered`` with, in each EXCHANGE, the RECV_ACT parts whose headers must be awaited
    before the batch (:attr:`~raypipe.core.ops.LoweredOp.header_first`) so that the dry-run
    completes.

    An activation's payload can be received only once its header (sent over a control
    channel as the sender reaches the op that sends it) gave its shape. Received after the
    batch (the default, and all that one chunk per worker needs), it waits until the batch
    completed: where the batch waits on a peer whose send waits on that payload (a ring of
    workers each sending on and receiving behind its batch), all wait forever. Awaited
    first, it goes in the batch; but the batch then waits for the header, which waits
    forever where the sender gets to that send only after something this batch sends.
    So, starting from every payload after its batch, each payload the dry-run finds
    behind a stuck batch with its header in (its sender got to the send, which may wait on
    it) is received in the batch instead, with the earlier activations from that peer in
    the exchange (a pair's messages are issued in order); in the same dry-run where its
    header was in as the batch was posted (nothing before changes), else in a new one, which
    goes on from the last one where the two agree (:func:`~raypipe.core.simulator.run_draft`'s
    ``after``: the run from the start, without the part both share); until the dry-run
    completes or finds none. Deterministic; each new dry-run moves at least one payload. With
    the sends the last dry-run finds waiting."""
    draft = None
    while True:
        draft = run_draft(lowered, placement, num_chunks, after=draft)  # goes on from the last one's run
        if not draft.late_payloads:
            return draft
        lowered = draft.lowered
        for stage, index, receive in draft.late_payloads:
            lowered[stage][index] = awaiting_header(lowered[stage][index], receive)


def _defer_waiting_sends(alone: list[list[LoweredOp]], placement: str, num_chunks: int) -> list[list[LoweredOp]]:
    """The lowering of ``alone`` (messages alone, receives in send order) where no send
    waits forever.

    With chunks, two workers may each send to the other and receive what the other
    sent only after a compute op: under the rendezvous rule both sends wait forever
    (on NCCL too: a pair's messages queue in issue order). Where the dry-run finds
    sends waiting, every one is moved after its worker's next compute op, ahead of
    the messages there, and posted with them in one EXCHANGE (every channel keeps
    its order); until none waits (moving one side of a cycle only can leave every
    worker waiting on a receive instead). A moved send leaves later: the cost, which
    :func:`~raypipe.core.timed_simulation.simulate_timed` counts. Sends that cannot move on
    are left for the dry-run to report."""
    alone = [list(ops) for ops in alone]
    while True:
        closed = _closed(alone, placement, num_chunks)
        lowered, waiting = closed.lowered, closed.stuck_sends
        moved = False
        for stage in sorted({stage for stage, _ in waiting}):
            ops = alone[stage]
            sends = [send for waiting_stage, send in waiting if waiting_stage == stage]  # all of one op, in order
            last = max(ops.index(send) for send in sends)
            following = next((i for i in range(last + 1, len(ops)) if ops[i].kind not in SENDS + RECEIVES), None)
            if following is not None:
                kept = [op for op in ops[:following + 1] if op not in sends]
                alone[stage] = kept + sends + ops[following + 1:]  # right after that compute op, in order
                moved = True
        if not moved:
            return lowered


def lower_stage(stage: int, ops: Sequence[Op], num_stages: int, placement: str = LOOPED) -> list[LoweredOp]:
    """The lowered ops of worker ``stage`` alone (see :func:`lower`), for one chunk per worker
    and whole backwards (B): with several chunks or a split backward (I, W), a worker's
    receives are placed after its peers' sends, so lower the whole schedule."""
    if _num_chunks(ops) > 1 or any(op.kind in (I, W) for op in ops):
        raise ValueError(f"stage {stage}: lowering one worker alone needs one chunk per worker and B ops; with "
                         f"{_num_chunks(ops)} chunk(s) and I/W its receives follow its peers' sends: "
                         f"lower the whole schedule")
    return _batch_exchanges(_communicating(stage, ops, num_stages, placement, 1)) + [
        LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)]


def _num_chunks(ops) -> int:
    return 1 + max((op.chunk for op in ops), default=0)


def _communicating(stage: int, ops: Sequence[Op], num_stages: int, placement: str = LOOPED,
                   num_chunks: int | None = None, paired: Collection[int] = ()) -> list[LoweredOp]:
    """``ops`` with a receive before and a send after each, where another worker is
    involved, each sent and received alone (:func:`lower` batches them later).
    ``paired``: the indexes of the F ops run with the B after them as one pair
    (:func:`_forward_backward_pairs`), whose receives both come before the F and whose
    sends both come after the B."""
    if num_chunks is None:
        num_chunks = _num_chunks(ops)
    for op in ops:
        if op.kind not in COMPUTE:
            raise ValueError(f"stage {stage}: unknown op kind {op.kind!r} in {op!r}")
        if not 0 <= op.chunk < num_chunks:
            raise ValueError(f"stage {stage}: {op!r} names chunk {op.chunk}, outside 0..{num_chunks - 1}")
    lowered = []
    index = 0
    others: dict[tuple[int, str], tuple[int, int] | None] = {}  # neighbour() per (chunk, message kind)

    def message(op: Op, kind: str) -> None:
        # the ``kind`` message of ``op``, or none where its virtual stage's neighbour is missing (an end of
        # the pipeline) or on this worker (used directly); the neighbour looked up once per chunk and kind
        if (op.chunk, kind) not in others:
            others[(op.chunk, kind)] = neighbour(stage, op.chunk, kind, num_stages, num_chunks, placement)
        other = others[(op.chunk, kind)]
        if other is not None and other[0] != stage:
            lowered.append(_lowered_op((kind, op.micro_batch, other[0], (), op.chunk, ())))

    while index < len(ops):
        segment = ops[index:index + 2] if index in paired else ops[index:index + 1]
        for op in segment:
            if op.kind in _COMMUNICATION:
                message(op, _COMMUNICATION[op.kind][0])
        lowered.extend(_lowered_op((op.kind, op.micro_batch, None, (), op.chunk, ())) for op in segment)
        for op in segment:
            if op.kind in _COMMUNICATION:
                message(op, _COMMUNICATION[op.kind][1])
        index += len(segment)
    return lowered


def _forward_backward_pairs(schedule: list[list[Op]], num_stages: int, num_chunks: int,
                            placement: str) -> list[set[int]]:
    """Per worker, the indexes of the F ops that it runs with the B right after them as one
    pair: Megatron's steady state, ``send_forward_backward_recv_forward_backward``.

    A pair receives the B's gradient with the F's input, before the F, and sends the F's
    activation with the B's gradient, after the B. Lowered one by one instead, a worker
    that alternates F and B hands an activation on and takes a gradient in between the
    two, while its neighbour, in the middle of its own F or B, has not posted the other
    ends: under the rendezvous rule one of them waits, every time. Pairs post once per
    F and B on every worker, and neighbours' pairs end together.

    The gradient comes from, and the activation goes to, the worker of the next virtual
    stage, which makes the gradient (op P) before the pair can start and takes the
    activation (op C) only once the pair ended: it waits for the pair unless it has at
    least the pair's work to run between P and C. So an F and the B after it pair only
    where that worker runs ops of at least F + B (at even cost) between the two, as it
    does in the steady state; not where a worker that runs all its forwards and then all
    its backwards (interleaving with m = p) is next to one that alternates, which needs
    the activation right after it made the gradient. Nor can a pair deadlock then: P
    comes before C on their worker, so P cannot wait on this F, whose only message goes
    to C. Where either message is missing (the last virtual stage makes no activation to
    send and takes no gradient), the F and the B pair."""
    where = [{op: index for index, op in enumerate(ops)} for ops in schedule]
    # per worker, the even cost of its ops before each index (its ops' costs, summed)
    cost_before = [[0.0] for _ in schedule]
    for worker, ops in enumerate(schedule):
        for op in ops:
            cost_before[worker].append(cost_before[worker][-1] + EVEN_COST[op.kind])

    def other_end(stage: int, op: Op, kind: str) -> tuple[int, int] | None:
        # the (worker, index) of the op on another worker that makes or takes the message ``kind`` of ``op``
        other = neighbour(stage, op.chunk, kind, num_stages, num_chunks, placement)
        if other is None or other[0] == stage:
            return None
        index = where[other[0]].get(Op(op.kind, op.micro_batch, other[1]))
        return None if index is None else (other[0], index)

    pairs = []
    for stage, ops in enumerate(schedule):
        paired: set[int] = set()
        index = 0
        while index + 1 < len(ops):
            forward, backward = ops[index], ops[index + 1]
            if forward.kind == F and backward.kind == B:
                maker = other_end(stage, backward, RECV_GRAD)  # P, which makes the B's gradient
                taker = other_end(stage, forward, SEND_ACT)  # C, which takes the F's activation
                if maker is None or taker is None or (maker[0] == taker[0] and (
                        cost_before[maker[0]][taker[1]] - cost_before[maker[0]][maker[1] + 1]  # between P and C
                        >= EVEN_COST[F] + EVEN_COST[B])):
                    paired.add(index)
                    index += 2
                    continue
            index += 1
        pairs.append(paired)
    return pairs


def _batch_exchanges(lowered: list[LoweredOp], every_run: bool = False) -> list[LoweredOp]:
    """``lowered`` with each run of consecutive sends and receives that sends to a
    peer it also receives from made one EXCHANGE (with ``every_run``, each run of two
    or more messages). Posting a run together never delays any of its messages, so it
    is done only where it can matter."""
    batched: list[LoweredOp] = []
    run: list[LoweredOp] = []
    for op in lowered + [None]:
        if op is not None and op.kind in _MESSAGES:
            run.append(op)
            continue
        if len(run) == 1 and not every_run:
            batched.append(run[0])  # one message neither sends to a peer it receives from nor makes a run
        elif run:
            sent_to = {part.peer for part in run if part.kind in SENDS}
            received_from = {part.peer for part in run if part.kind in RECEIVES}
            batched.extend([exchange(*run)] if sent_to & received_from or (every_run and len(run) > 1) else run)
        run = []
        if op is not None:
            batched.append(op)
    return batched
