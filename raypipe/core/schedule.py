"""Pipeline schedules as pure data: per worker, the ordered ops. No Ray, no torch.

A schedule is ``list[list[Op]]``: ``schedule[stage]`` is the order in which that
worker runs its forward (F) and backward (B, or the input gradient I and later
the weight gradient W) ops, each on one micro-batch of one of its ``v`` model
chunks (:data:`PLACEMENT` says which virtual stage each chunk is).
:mod:`raypipe.core.lowering` adds the sends, receives and collectives;
:mod:`raypipe.core.simulator` checks the result runs (``make_schedule`` does for
every schedule) and orders it for the per-op executor, whose submission order is
the schedule.

Memory is counted in :func:`max_in_flight` units: one unit is one micro-batch's
activations of one chunk (1/v of the worker's layers), held from its F until its
backward no longer needs it (B, or W after I).
"""
from __future__ import annotations

import functools

from collections import deque

from raypipe.core.list_scheduling import list_scheduled_zbv
from raypipe.core.lowering import lower
from raypipe.core.ops import LOOPED, V_SHAPED, B, F, I, LoweredOp, Op, W
from raypipe.core.simulator import simulate

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
# one chunk per worker (virtual_stages=1); the others hold several (interleaved_1f1b v >= 2, zbv v = 2)
SINGLE_CHUNK_SCHEDULES = ("gpipe", "1f1b", "zb_h1")
# The chunks per worker each schedule holds unless told otherwise (PipelineConfig.virtual_stages=None): the only
# value zbv takes, interleaved_1f1b's least (and Megatron's usual), one for the others.
NATURAL_CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}
# Where each schedule puts its chunks (see raypipe.core.ops.PLACEMENTS); one chunk per worker is placed alike by both.
PLACEMENT = {"gpipe": LOOPED, "1f1b": LOOPED, "interleaved_1f1b": LOOPED, "zb_h1": LOOPED, "zbv": V_SHAPED}


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


def interleaved_1f1b_schedule(num_stages: int, num_micro_batches: int, num_chunks: int) -> list[list[Op]]:
    """Megatron's interleaved 1F1B: each worker holds ``num_chunks`` (v >= 2) chunks, chunk c
    of worker s being virtual stage c * p + s (activations wrap from the last worker to the first).

    Shape: micro-batches go in rounds of q (:func:`interleaved_round_size`: p when m is a
    multiple of p, as Megatron's; else m // max(1, m // p), the "flex" order of torch's
    ``ScheduleInterleaved1F1B``: one round of m when m < 2p, rounds of 5 at p = 4, m = 10). A
    worker's forwards run round by round, and within a round chunk by chunk (F of the round's q
    micro-batches on chunk 0, then on chunk 1, ...); its backwards run in the same order with the
    chunks reversed. Worker s warms up with 2(p - 1 - s) + (v - 1)q forwards (at most all m*v),
    then alternates one forward and one backward, then drains the backwards. Each boundary between
    virtual stages costs 1/v of a stage, so with equal stage times and whole rounds of p the bubble
    is (p - 1)/(v*m + p - 1) of the step (its idle time 1/v of 1F1B's), for v times the messages.
    That holds under NCCL's rendezvous rule too, with messages taking no time: the lowering posts
    each F's and the following B's messages together, as Megatron does
    (:func:`raypipe.core.lowering.lower`).
    One round of m < p leaves worker 0 waiting for the wrap from the last worker before its chunk 1
    (F = 1, B = 2 a stage, v = 2, p = 4, m = 3: a step of 15 units against 1F1B's 18). Rounds of
    q > p hand the wrap's activations on q - p ops before worker 0 takes them: the lowering posts
    those receives when the message is sent, so the last worker's sends do not wait and the step is
    the schedule's own, as with buffered sends (p = 4: 19.5, 22.5, 25.5 and 34.5 units at m = 5, 6,
    7 and 10 against 1F1B's 24, 27, 30 and 39).

    Memory: worker s holds at most 2(p - 1 - s) + (v - 1)q + 1 chunk-activations (each 1/v of
    its layers; at most all m*v): with q = p, worker 0 holds (p(v + 1) - 1)/v stages' worth,
    against 1F1B's p, so a little more (at v = 2, about 1.5p). Posting an F's and the following
    B's messages together also holds, across the other op, the F's output until it is sent after
    the B and the B's incoming gradient from before the F: two boundary tensors (one layer's
    input each), as in Megatron. With rounds of q > p, worker 0 also holds each activation received
    at the wrap from when it is sent until its F, up to q - p ops later (one boundary tensor each).

    Raises ``ValueError`` unless v >= 2 and m splits into max(1, m // p) equal rounds
    (:func:`check_interleaved_micro_batches`, torch's rule).
    """
    _check_sizes(num_stages, num_micro_batches)
    if num_chunks < 2:
        raise ValueError(f"interleaved_1f1b needs v >= 2 chunks per worker, got v={num_chunks}")
    check_interleaved_micro_batches(num_stages, num_micro_batches)
    round_size = interleaved_round_size(num_stages, num_micro_batches)
    total = num_micro_batches * num_chunks  # F (and B) ops per worker

    def nth(kind: str, index: int) -> Op:
        # the index-th F (or B) of a worker: round, then chunk (reversed for B), then micro-batch in the round
        round_, within = divmod(index, round_size * num_chunks)
        chunk, offset = divmod(within, round_size)
        return Op(kind, round_ * round_size + offset, chunk if kind == F else num_chunks - 1 - chunk)

    schedule = []
    for stage in range(num_stages):
        warmup = min(2 * (num_stages - 1 - stage) + (num_chunks - 1) * round_size, total)
        ops = [nth(F, index) for index in range(warmup)]
        for index in range(total - warmup):
            ops += [nth(F, warmup + index), nth(B, index)]
        ops += [nth(B, index) for index in range(total - warmup, total)]
        schedule.append(ops)
    return schedule


def interleaved_round_size(num_stages: int, num_micro_batches: int) -> int:
    """The micro-batches in each round of interleaved_1f1b: m split into max(1, m // p) equal rounds
    (p when m is a multiple of p; m itself, one round, when m < 2p; 5 at p = 4, m = 10 or 15)."""
    return num_micro_batches // max(1, num_micro_batches // num_stages)


def interleaved_runs(num_stages: int, num_micro_batches: int) -> bool:
    """Whether interleaved_1f1b runs m micro-batches on p workers (:func:`check_interleaved_micro_batches`)."""
    return num_micro_batches % max(1, num_micro_batches // num_stages) == 0


def check_interleaved_micro_batches(num_stages: int, num_micro_batches: int) -> None:
    """Raise ``ValueError`` unless interleaved_1f1b runs m micro-batches on p workers: m that splits
    into max(1, m // p) equal rounds (:func:`interleaved_round_size`), the rule of
    torch.distributed.pipelining's ``ScheduleInterleaved1F1B``. At p = 4: m = 1-8, 10, 12, 15, 16, ...

    Rounds longer than p (m = 5-7 and 10, 15 at p = 4) hand an activation to the wrap from the last
    worker to the first before the first worker takes it: the lowering posts such receives when the
    message is sent (:func:`raypipe.core.lowering.lower`), so those run too."""
    if interleaved_runs(num_stages, num_micro_batches):
        return
    p, m = num_stages, num_micro_batches
    accepted = [count for count in range(1, 4 * p + 1) if interleaved_runs(p, count)]
    raise ValueError(f"interleaved_1f1b needs m micro-batches that split into max(1, m // p) equal rounds (the "
                     f"rule of torch's ScheduleInterleaved1F1B): m={m}, p={p}: {m} does not split into {m // p} "
                     f"equal rounds; at p={p} m may be {', '.join(map(str, accepted))}, ...")


def zb_h1_schedule(num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """ZB-H1 (arXiv 2401.10241, section 3): 1F1B with the backward split, each weight gradient
    deferred into the drain's bubble.

    Shape: stage s warms up with p - 1 - s forwards as 1F1B does, then runs F and I
    in turn; its W of a micro-batch waits until s later input gradients have run (at
    most s W pending), and the s still pending at the end fill the drain, where 1F1B's
    stage s idles while the gradients climb from the last stage. With F = I = W the
    bubble is (p - 1)F, a third of 1F1B's (p - 1)(F + B), so about (p - 1)/(3m + p - 1)
    of the step.

    Memory: 1F1B's. Stage s holds at most p - s micro-batches between F and I and s
    between I and W: p in all, as 1F1B's stage 0 (a deferred W holds less than a whole
    activation: the layer inputs and output gradients its weights need).
    """
    _check_sizes(num_stages, num_micro_batches)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_micro_batches)
        ops = [Op(F, mb) for mb in range(warmup)]
        deferred: deque[int] = deque()
        for mb in range(num_micro_batches):
            if warmup + mb < num_micro_batches:
                ops.append(Op(F, warmup + mb))
            ops.append(Op(I, mb))
            deferred.append(mb)
            if len(deferred) > stage:
                ops.append(Op(W, deferred.popleft()))
        ops += [Op(W, mb) for mb in deferred]
        schedule.append(ops)
    return schedule


def zbv_schedule(num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """ZB-V (arXiv 2401.10241, section 6): two chunks per worker in a V, with the backward split.

    Chunk 0 of worker s is virtual stage s and chunk 1 is 2p - 1 - s: the forward goes
    down the workers on chunk 0, turns on worker p - 1 (its chunk 0 feeds its chunk 1
    with no message) and comes back up on chunk 1 to the loss on worker 0, and the
    backward retraces it.

    With F = I = W (one unit a chunk op) no order can beat the work bound, a step of
    6m + p - 1 units (:mod:`raypipe.core.list_scheduling`): a bubble of (p - 1)/(6m + p - 1),
    0.059 at p = 4, m = 8, 0.030 at m = 16 and 0.068 at p = 8, m = 16 (1F1B: 0.273, 0.158,
    0.304). The paper's V (:func:`v_shaped_zbv`) reaches it once 2m >= 3p - 1. With fewer
    micro-batches its step is 4(m + p) - 2 units, and the order is list-scheduled instead
    wherever that is shorter (:func:`~raypipe.core.list_scheduling.list_scheduled_zbv`): at
    p = 8, m = 8 a step of 55 units, the work bound, against the V's 62 (a bubble of 0.127
    against 0.226).

    Memory: worker s holds at most 2p chunk-activations (chunk-F to W; each 1/2 of its
    layers): p stages' worth, as 1F1B's stage 0, on every worker, in either order.
    """
    _check_sizes(num_stages, num_micro_batches)
    if 2 * num_micro_batches < 3 * num_stages - 1:  # below this the V idles beyond the work bound
        listed, step = list_scheduled_zbv(num_stages, num_micro_batches)
        if step < 4 * (num_micro_batches + num_stages) - 2:
            return listed
    return v_shaped_zbv(num_stages, num_micro_batches)


def v_shaped_zbv(num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """ZB-V in the paper's fixed shape (its figure 6, torch's ``ScheduleZBVZeroBubble`` op for op).

    Shape, worker s: 2(p - s) - 1 forwards of chunk 0; s pairs (F chunk 1, F chunk 0);
    p - s rounds (F, I, W of chunk 1); then rounds (F, I, W of chunk 0, then F, I, W of
    chunk 1) until every forward ran; then s pairs (I chunk 0, I chunk 1) and p - s pairs
    (I, W of chunk 0); then the pending Ws of chunk 1, then of chunk 0. With m < 2p - 1 the
    shape is built for 2p - 1 micro-batches and the ops of the missing ones left out, which
    keeps it valid. Its step at F = I = W is max(6m + p - 1, 4(m + p) - 2) units.
    """
    _check_sizes(num_stages, num_micro_batches)
    p = num_stages
    built = max(num_micro_batches, 2 * p - 1)
    schedule = []
    for stage in range(p):
        ops: list[Op] = []
        count = {(kind, chunk): 0 for kind in (F, I, W) for chunk in (0, 1)}

        def run(kind: str, chunk: int) -> None:
            ops.append(Op(kind, count[(kind, chunk)], chunk))
            count[(kind, chunk)] += 1

        for _ in range(2 * (p - stage) - 1):
            run(F, 0)
        for _ in range(stage):
            run(F, 1)
            run(F, 0)
        for _ in range(p - stage):
            for kind in (F, I, W):
                run(kind, 1)
        while count[(F, 0)] < built or count[(F, 1)] < count[(F, 0)]:
            if count[(F, 0)] < built:
                run(F, 0)
            run(I, 0)
            run(W, 0)
            for kind in (F, I, W):
                run(kind, 1)
        for _ in range(stage):
            run(I, 0)
            run(I, 1)
        for _ in range(p - stage):
            run(I, 0)
            run(W, 0)
        for chunk in (1, 0):
            while count[(W, chunk)] < count[(I, chunk)]:
                run(W, chunk)
        schedule.append([op for op in ops if op.micro_batch < num_micro_batches])
    return schedule


def make_schedule(name: str, num_stages: int, num_micro_batches: int, num_chunks: int = 1) -> list[list[Op]]:
    """The schedule called ``name`` (one of :data:`SCHEDULES`) with ``num_chunks`` (v) chunks
    per worker, checked by a dry-run.

    v is 1 for gpipe, 1f1b and zb_h1, >= 2 for interleaved_1f1b, and 2 for zbv; another v
    is a ``ValueError`` that says so, as is an interleaved_1f1b whose m it cannot run
    (:func:`check_interleaved_micro_batches`: m that splits into max(1, m // p) equal rounds).
    Raises :class:`~raypipe.core.simulator.ScheduleError` when the lowered
    schedule would deadlock, mis-pair messages or run compute ops out of place.
    """
    check_chunks(name, num_chunks)
    if name == "interleaved_1f1b":
        schedule = interleaved_1f1b_schedule(num_stages, num_micro_batches, num_chunks)
    elif name == "zbv":
        schedule = zbv_schedule(num_stages, num_micro_batches)
    else:
        builder = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule, "zb_h1": zb_h1_schedule}[name]
        schedule = builder(num_stages, num_micro_batches)
    dry_run(schedule, PLACEMENT[name])
    return schedule


def check_chunks(name: str, num_chunks: int) -> None:
    """Raise ``ValueError`` unless schedule ``name`` holds ``num_chunks`` (v) chunks per worker:
    v >= 2 for interleaved_1f1b, v = 2 for zbv, v = 1 for the others."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: expected one of {SCHEDULES}")
    if name == "interleaved_1f1b":
        if num_chunks < 2:
            raise ValueError(f"interleaved_1f1b needs v >= 2 chunks per worker, got v={num_chunks}")
    elif name == "zbv":
        if num_chunks != 2:
            raise ValueError(f"zbv holds exactly v=2 chunks per worker (a V), got v={num_chunks}")
    elif num_chunks != 1:
        raise ValueError(f"{name} holds one chunk per worker (v=1), got v={num_chunks}: "
                         f"interleaved_1f1b (v >= 2) and zbv (v = 2) hold more")


def dry_run(schedule: list[list[Op]], placement: str = LOOPED) -> tuple[tuple[int, LoweredOp], ...]:
    """The simulator's order of the lowered ``schedule`` (each stage's order kept,
    every receive after the op that made what it receives): the per-op executor submits in it.
    ``placement`` is the schedule's (:data:`PLACEMENT`); one chunk per worker is placed alike by all."""
    return _dry_run(tuple(tuple(ops) for ops in schedule), placement)


@functools.lru_cache(maxsize=256)
def _dry_run(schedule: tuple[tuple[Op, ...], ...], placement: str) -> tuple[tuple[int, LoweredOp], ...]:
    # once per distinct schedule: the memory planner builds thousands while it searches
    return tuple(simulate(lower([list(ops) for ops in schedule], placement), placement))


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle fraction of a GPipe/1F1B step with equal stage times: (p-1)/(m+p-1)."""
    _check_sizes(num_stages, num_micro_batches)
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def max_in_flight(schedule: list[list[Op]]) -> list[int]:
    """Per stage, the most (chunk, micro-batch) pairs whose forward ran but whose backward has not
    finished: held from F until B, or until W where the backward is split (the input until I,
    then what W needs until W). One unit is one micro-batch's activations of one chunk."""
    peaks = []
    for ops in schedule:
        in_flight = peak = 0
        for op in ops:
            in_flight += {F: 1, B: -1, W: -1}.get(op.kind, 0)  # I frees part only: counted held until W
            peak = max(peak, in_flight)
        peaks.append(peak)
    return peaks


def max_in_flight_split(schedule: list[list[Op]]) -> list[tuple[int, int]]:
    """Per stage, the most pairs held for an input gradient (F run, B/I not) and the most held
    only for a deferred weight gradient (I run, W not), each peak on its own."""
    peaks = []
    for ops in schedule:
        for_input = for_weight = peak_input = peak_weight = 0
        for op in ops:
            for_input += {F: 1, B: -1, I: -1}.get(op.kind, 0)
            for_weight += {I: 1, W: -1}.get(op.kind, 0)
            peak_input, peak_weight = max(peak_input, for_input), max(peak_weight, for_weight)
        peaks.append((peak_input, peak_weight))
    return peaks


def _check_sizes(num_stages: int, num_micro_batches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
