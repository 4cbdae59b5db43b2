"""The timed run of lowered schedules against closed forms worked out by hand: no Ray or torch, milliseconds.

Times are multiples of 1/8 throughout, so every sum is exact in floating point and
the closed forms are checked with ``==``.
"""
import random
import re
import subprocess
import sys

import pytest

from raypipe.core.lowering import lower
from raypipe.core.ops import (B, EXCHANGE, F, OPTIMIZER_STEP, RECEIVES, RECV_ACT, REDUCE_GRAD, SEND_ACT, SENDS,
                              LoweredOp, Op)
from raypipe.core.schedule import gpipe_schedule, one_f_one_b_schedule
from raypipe.core.simulator import ScheduleError, simulate
from raypipe.core.timed_simulation import TimedOp, TimedRun, simulate_timed
from tests.core.test_simulator import assert_valid_order, unpaired

SIZES = [(p, m) for p in range(1, 9) for m in range(1, 17)]
SCHEDULE_BUILDERS = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}
COLLECTIVES = (REDUCE_GRAD, OPTIMIZER_STEP)


@pytest.mark.parametrize("name", SCHEDULE_BUILDERS)
@pytest.mark.parametrize("forward,backward", [(1, 1), (1, 2), (0.5, 1.5)])
def test_equal_stages_without_message_time_take_the_textbook_step_and_bubble(name, forward, backward):
    # With equal stages and free messages, GPipe and 1F1B both take (m+p-1)(F+B): the first
    # forward needs p-1 stage times to reach the last stage, the last backward p-1 to come
    # back, and every stage does m(F+B) of compute; the bubble is (p-1)/(m+p-1).
    for p, m in SIZES:
        run = simulate_timed(lower(SCHEDULE_BUILDERS[name](p, m)), {F: forward, B: backward}, 0.0)
        assert run.step_s == (m + p - 1) * (forward + backward), (p, m)
        assert run.busy_s == (m * (forward + backward),) * p
        assert run.bubble_fraction == ((p - 1) / (m + p - 1),) * p, (p, m)


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("backward", [1, 2])
def test_gpipe_pays_each_blocking_message_it_waits_on(p, m, backward):
    # Every transfer starts only when both ends are posted and blocks both workers, and a
    # stage posts a receive only when it reaches it (right before the op that needs it).
    # So a message costs c on the critical path wherever it lies, not only in the fill and
    # drain:
    # - the first micro-batch crosses p-1 links forward and p-1 back: 2(p-1)c, the whole
    #   cost when m = 1;
    # - after it, in each direction, a middle stage runs receive (c), compute, send (c) per
    #   micro-batch, in lock-step with its neighbours, so each further micro-batch adds 2c
    #   per direction; with p = 2 each stage only sends or only receives per direction: c.
    # Step = (m+p-1)(F+B) + 2(p-1)c + 2(m-1)·min(p-1, 2)·c.
    forward, c = 1.0, 0.25
    run = simulate_timed(lower(gpipe_schedule(p, m)), {F: forward, B: backward}, c)
    blocking_messages_per_micro_batch = min(p - 1, 2)
    assert run.step_s == ((m + p - 1) * (forward + backward) + 2 * (p - 1) * c
                          + 2 * (m - 1) * blocking_messages_per_micro_batch * c)
    assert run.busy_s == (m * (forward + backward),) * p


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("backward", [1, 2])
def test_gpipe_with_buffered_sends_pays_the_messages_of_the_fill_and_the_drain_only(p, m, backward):
    # A buffered message leaves as its send is posted and arrives c later, and no send holds
    # its worker. Stage s's F(i) then starts at max(end of its F(i-1), end of stage s-1's F(i)
    # + c): by induction it ends at (i+s+1)F + s·c, so the last forward ends at
    # (m+p-1)F + (p-1)c; the backward comes back the same way: +(m+p-1)B + (p-1)c.
    forward, c = 1.0, 0.25
    run = simulate_timed(lower(gpipe_schedule(p, m)), {F: forward, B: backward}, c, buffered_sends=True)
    assert run.step_s == (m + p - 1) * (forward + backward) + 2 * (p - 1) * c
    assert run.busy_s == (m * (forward + backward),) * p


def test_a_send_waits_for_its_receive_to_be_posted_and_the_sender_is_not_busy_meanwhile():
    # GPipe, 2 stages, 3 micro-batches; stage 1's forward takes 5 s, everything else 1 s, a
    # message 0.5 s. Stage 0: F0 [0, 1], SEND_ACT0 [1, 1.5] (stage 1 posted RECV_ACT0 at 0),
    # F1 [1.5, 2.5], then SEND_ACT1 posted at 2.5; stage 1 posts RECV_ACT1 only after its
    # F0 [1.5, 6.5], so the transfer runs [6.5, 7] and stage 0 waits from 2.5 to 6.5.
    lowered = lower(gpipe_schedule(2, 3))
    run = simulate_timed(lowered, {F: 1, B: 1, (1, F): 5}, 0.5)
    timeline = {(stage, op): (start, end) for stage, op, start, end in run.timeline}
    assert timeline[(0, LoweredOp(F, 0))] == (0, 1)
    assert timeline[(0, LoweredOp(SEND_ACT, 0, 1))] == (1, 1.5)
    assert timeline[(0, LoweredOp(F, 1))] == (1.5, 2.5)
    assert timeline[(1, LoweredOp(F, 0))] == (1.5, 6.5)
    assert timeline[(0, LoweredOp(SEND_ACT, 1, 1))] == (2.5, 7)  # 4 s waiting, then the transfer
    assert timeline[(0, LoweredOp(F, 2))] == (7, 8)
    assert run.busy_s[0] == 6  # three F and three B of 1 s: the wait is not busy time

    # buffered, the send completes as it is posted; stage 1 gets the activation at 3, before it asks
    buffered = simulate_timed(lowered, {F: 1, B: 1, (1, F): 5}, 0.5, buffered_sends=True)
    timeline = {(stage, op): (start, end) for stage, op, start, end in buffered.timeline}
    assert timeline[(0, LoweredOp(SEND_ACT, 0, 1))] == (1, 1)
    assert timeline[(1, LoweredOp(RECV_ACT, 0, 0))] == (0, 1.5)
    assert timeline[(0, LoweredOp(SEND_ACT, 1, 1))] == (2, 2)
    assert timeline[(1, LoweredOp(RECV_ACT, 1, 0))] == (6.5, 6.5)
    assert timeline[(0, LoweredOp(F, 2))] == (2, 3)
    assert buffered.busy_s == run.busy_s


def _random_times(rng, lowered):
    """Per (stage, kind) compute times and per message times, multiples of 1/8 in [1/8, 2]."""
    op_seconds = {(stage, kind): rng.randint(1, 16) / 8 for stage in range(len(lowered)) for kind in (F, B)}
    message_times = {}

    def message_seconds(sender, receiver, send):
        assert send.kind in SENDS and send.peer == receiver  # both ends ask about the send
        return message_times.setdefault((sender, receiver, send), rng.randint(1, 16) / 8)

    return op_seconds, message_seconds, message_times


@pytest.mark.parametrize("seed", range(40))
def test_busy_time_is_the_sum_of_the_compute_ops_and_the_run_keeps_the_rendezvous_rule(seed):
    rng = random.Random(seed)
    name = rng.choice(sorted(SCHEDULE_BUILDERS))
    p, m = rng.randint(1, 6), rng.randint(1, 8)
    lowered = lower(SCHEDULE_BUILDERS[name](p, m))
    op_seconds, message_seconds, message_times = _random_times(rng, lowered)
    run = simulate_timed(lowered, op_seconds, message_seconds)
    assert isinstance(run, TimedRun)
    for stage, ops in enumerate(lowered):
        assert run.busy_s[stage] == sum(op_seconds[(stage, op.kind)] for op in ops if op.kind in (F, B))
        assert run.bubble_fraction[stage] == (run.step_s - run.busy_s[stage]) / run.step_s
    assert run.step_s == max(end for _, _, _, end in run.timeline)
    _assert_the_timed_rule(lowered, run, op_seconds, message_times)
    # ordered by completion time (ties in the dry-run's order), the run is a valid order
    ordered = sorted(enumerate(run.timeline), key=lambda item: (item[1].end, item[0]))
    assert_valid_order(lowered, [(timed.stage, timed.op) for _, timed in ordered])
    # buffered sends hold nobody: the same compute, a step no longer, every op ending no later
    buffered = simulate_timed(lowered, op_seconds, message_seconds, buffered_sends=True)
    assert buffered.busy_s == run.busy_s and buffered.step_s <= run.step_s
    assert all(fast.end <= slow.end for fast, slow in zip(buffered.timeline, run.timeline))


def _assert_the_timed_rule(lowered, run, op_seconds, message_times):
    """The rule checked op by op from the timeline alone: each worker runs its ops back to
    back from 0; a compute op takes its time; a SEND/RECV/EXCHANGE ends when its last
    message does, a message starting when both its ends are posted, an exchange's
    activation receive (one chunk per worker: at most one, last) posted only once the rest
    of the exchange (its batch) completed; a collective starts when every worker has reached it."""
    spans = {stage: [(timed.start, timed.end) for timed in run.timeline if timed.stage == stage]
             for stage in range(len(lowered))}
    for stage, ops in enumerate(lowered):
        assert [timed.op for timed in run.timeline if timed.stage == stage] == ops
        ends = [0.0] + [end for _, end in spans[stage]]
        assert [start for start, _ in spans[stage]] == ends[:-1]
    sent, received = {}, {}  # per channel, each end as (stage, op index, place in the op), in issue order
    for stage, ops in enumerate(lowered):
        for index, op in enumerate(ops):
            parts = op.parts if op.kind == EXCHANGE else (op,)
            assert [part.kind for part in parts].count(RECV_ACT) <= 1 and not op.header_first
            for place, part in enumerate(parts):
                if part.kind in SENDS:
                    sent.setdefault((stage, part.peer), []).append((stage, index, place))
                elif part.kind in RECEIVES:
                    received.setdefault((part.peer, stage), []).append((stage, index, place))
    other_end, time_of = {}, {}
    for channel, sends in sent.items():
        for send_end, receive_end in zip(sends, received[channel]):
            other_end[send_end], other_end[receive_end] = receive_end, send_end
            send = lowered[send_end[0]][send_end[1]]
            time_of[send_end] = time_of[receive_end] = message_times[
                (*channel, send.parts[send_end[2]] if send.kind == EXCHANGE else send)]
    posted = {end: spans[end[0]][end[1]][0] for end in other_end}  # raised to the batch's end where received after
    ends_of_parts, settled = {}, None
    while settled != posted:  # to the fixed point: each round settles at least one more posting
        settled = dict(posted)
        for end in posted:
            ends_of_parts[end] = max(posted[end], posted[other_end[end]]) + time_of[end]
        batch_ends = {}
        for (stage, index, place), end in ends_of_parts.items():
            op = lowered[stage][index]
            if op.kind == EXCHANGE and op.parts[place].kind != RECV_ACT:
                batch_ends[(stage, index)] = max(end, batch_ends.get((stage, index), spans[stage][index][0]))
        for (stage, index, place) in posted:
            op = lowered[stage][index]
            if op.kind == EXCHANGE and op.parts[place].kind == RECV_ACT:
                posted[(stage, index, place)] = batch_ends.get((stage, index), spans[stage][index][0])
    for stage, ops in enumerate(lowered):
        for index, op in enumerate(ops):
            start, end = spans[stage][index]
            if op.kind in (F, B):
                assert end - start == op_seconds[(stage, op.kind)]
            elif op.kind in COLLECTIVES:
                from_the_end = index - len(ops)  # the collectives close every stage
                assert end == max(spans[other][from_the_end][0] for other in spans)
            else:
                assert end == max(ends_of_parts[(stage, index, place)] for place in range(len(op.unbatched())))


@pytest.mark.parametrize("name", SCHEDULE_BUILDERS)
@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 8), (8, 16)])
def test_with_no_time_every_op_takes_none_and_the_order_is_the_dry_runs(name, p, m):
    lowered = lower(SCHEDULE_BUILDERS[name](p, m))
    run = simulate_timed(lowered, {F: 0, B: 0}, 0)
    assert [(stage, op) for stage, op, _, _ in run.timeline] == simulate(lowered)
    assert {(start, end) for _, _, start, end in run.timeline} == {(0.0, 0.0)}
    assert run.step_s == 0 and run.bubble_fraction == (0.0,) * p


def test_collectives_start_when_every_worker_has_reached_them_and_take_their_time():
    # GPipe, 3 stages, 1 micro-batch, F = B = 1: stage 0 ends its backward at 6, stage 2 at 4.
    lowered = lower(gpipe_schedule(3, 1))
    run = simulate_timed(lowered, {F: 1, B: 1, REDUCE_GRAD: 0.5, (1, OPTIMIZER_STEP): 2}, 0)
    timeline = {(stage, op.kind): (start, end) for stage, op, start, end in run.timeline}
    assert timeline[(2, REDUCE_GRAD)] == (4, 6.5)  # reached at 4, starts at 6 with stage 0
    assert timeline[(0, REDUCE_GRAD)] == (6, 6.5)
    assert [timeline[(stage, OPTIMIZER_STEP)] for stage in range(3)] == [(6.5, 6.5), (6.5, 8.5), (6.5, 6.5)]
    assert run.step_s == 8.5
    assert run.busy_s == (2, 2, 2)  # collectives are not compute


def test_op_seconds_may_be_a_callable_of_stage_and_op_and_it_also_times_the_collectives():
    asked = []

    def op_seconds(stage, op):
        asked.append((stage, op))
        return {F: 1, B: 2}.get(op.kind, 0)

    lowered = lower(one_f_one_b_schedule(2, 2))
    run = simulate_timed(lowered, op_seconds, lambda sender, receiver, send: 0)
    assert sorted(asked) == sorted((stage, op) for stage, ops in enumerate(lowered) for op in ops
                                   if op.kind in (F, B) + COLLECTIVES)
    assert run.step_s == (2 + 2 - 1) * 3
    assert all(isinstance(timed, TimedOp) for timed in run.timeline)


def test_deadlocks_and_mismatches_raise_the_dry_runs_error():
    deadlocked = unpaired(one_f_one_b_schedule(3, 4))
    with pytest.raises(ScheduleError, match="^deadlock: ") as timed:
        simulate_timed(deadlocked, {F: 1, B: 1}, 0.5)
    with pytest.raises(ScheduleError) as dry:
        simulate(deadlocked)
    assert str(timed.value) == str(dry.value)

    mismatched = lower(gpipe_schedule(2, 2))
    receives = [op for op in mismatched[1] if op.kind == RECV_ACT]
    mismatched[1] = receives[::-1] + [op for op in mismatched[1] if op.kind != RECV_ACT]  # 1 meets 0's send
    with pytest.raises(ScheduleError, match=re.escape("mismatch: stage 1 runs RECV_ACT1<-0 but the message it "
                                                      "meets, stage 0's next in issue order, is SEND_ACT0->1")):
        simulate_timed(mismatched, {F: 1, B: 1}, 0)


@pytest.mark.parametrize("op_seconds,message_seconds,message", [  # stage 1 runs the first B
    ({F: 1}, 0, "op_seconds gives no time for B0 on stage 1: add 'B' or (1, 'B') to it"),
    ({F: 1, B: -1}, 0, "op_seconds gives -1 seconds for B0 on stage 1: a time is finite and >= 0"),
    ({F: 1, B: float("nan")}, 0, "op_seconds gives nan seconds for B0 on stage 1"),
    ({F: 1, B: 1}, -0.5, "message_seconds is -0.5 seconds"),
    ({F: 1, B: 1}, lambda sender, receiver, send: "fast", "message_seconds gives 'fast' seconds for SEND_ACT0->1 "
                                                         "from stage 0 to stage 1: a time is a number of seconds"),
])
def test_bad_times_are_refused_naming_the_op(op_seconds, message_seconds, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        simulate_timed(lower(gpipe_schedule(2, 1)), op_seconds, message_seconds)


def test_op_seconds_of_another_type_is_refused():
    with pytest.raises(TypeError, match="^op_seconds must be a mapping"):
        simulate_timed(lower(gpipe_schedule(1, 1)), 1.0, 0)


def test_a_timed_run_is_frozen():
    run = simulate_timed(lower([[Op(F, 0), Op(B, 0)]]), {F: 1, B: 1})
    with pytest.raises(AttributeError):
        run.step_s = 0
    assert run == TimedRun(step_s=2, busy_s=(2,), bubble_fraction=(0,),
                           timeline=(TimedOp(0, LoweredOp(F, 0), 0, 1), TimedOp(0, LoweredOp(B, 0), 1, 2),
                                     TimedOp(0, LoweredOp(REDUCE_GRAD), 2, 2),
                                     TimedOp(0, LoweredOp(OPTIMIZER_STEP), 2, 2)))


def test_the_timed_run_needs_neither_ray_nor_torch_and_imports_in_any_order():
    for first, second in [("raypipe.core.timed_simulation", "raypipe.core.simulator"),
                          ("raypipe.core.simulator", "raypipe.core.timed_simulation")]:
        code = (f"import sys, {first}, {second}; "
                "from raypipe.core.timed_simulation import simulate_timed; "
                "from raypipe.core.schedule import gpipe_schedule; from raypipe.core.lowering import lower; "
                "assert simulate_timed(lower(gpipe_schedule(2, 2)), {'F': 1, 'B': 1}).step_s == 6; "
                "assert 'torch' not in sys.modules and 'ray' not in sys.modules")
        subprocess.run([sys.executable, "-c", code], check=True)


def test_the_timed_run_is_not_reached_through_the_simulator():
    # timed_simulation builds on simulator, never the other way: the old path names the new one
    with pytest.raises(ImportError, match="is now raypipe.core.timed_simulation.simulate_timed"):
        from raypipe.core.simulator import simulate_timed  # noqa: F401


@pytest.mark.parametrize("name, chunks", [("interleaved_1f1b", 2), ("zbv", 2), ("1f1b", 1)])
def test_given_events_time_the_run_as_its_own_dry_run_does(name, chunks):
    # the dry-run's events depend on the ops alone: a caller timing one schedule under many times
    # (the step predictor's search) passes them once computed, and gets the same run
    from raypipe.core.schedule import PLACEMENT, make_schedule
    from raypipe.core.simulator import simulate_events

    placement = PLACEMENT[name]
    lowered = lower(make_schedule(name, 4, 8, chunks), placement)
    events = simulate_events(lowered, placement)
    for seconds in ({"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, {"F": 0.5, "B": 1.5, "I": 0.625, "W": 0.875}):
        for message in (0.0, 0.25):
            alone = simulate_timed(lowered, seconds, message, buffered_sends=True, placement=placement)
            given = simulate_timed(lowered, seconds, message, buffered_sends=True, placement=placement, events=events)
            assert given == alone
