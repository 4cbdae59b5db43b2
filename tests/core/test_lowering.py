"""Lowering a compute schedule adds the sends, receives and collectives: pure data, no Ray or torch."""
import hashlib

import pytest

from raypipe.core import lowering
from raypipe.core.lowering import lower
from raypipe.core.ops import (B, EXCHANGE, F, LOOPED, OPTIMIZER_STEP, RECV_ACT, RECV_GRAD, REDUCE_GRAD, SEND_ACT,
                              SEND_GRAD, LoweredOp, Op, exchange, unbatch)
from raypipe.core.schedule import gpipe_schedule, interleaved_1f1b_schedule, one_f_one_b_schedule, zb_h1_schedule
from raypipe.core.simulator import simulate
from raypipe.core.timed_simulation import simulate_timed

BUILDERS = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}
SIZES = [(p, m) for p in range(1, 5) for m in range(1, 9)]
# Which way each point-to-point kind talks: +1 to the next stage, -1 to the previous.
DIRECTION = {SEND_ACT: +1, RECV_ACT: -1, SEND_GRAD: -1, RECV_GRAD: +1}


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("p,m", SIZES)
def test_lowering_adds_one_message_per_boundary_and_micro_batch(name, p, m):
    schedule = BUILDERS[name](p, m)
    lowered = lower(schedule)
    assert len(lowered) == p
    for stage, batched in enumerate(lowered):
        ops = unbatch(batched)
        has_previous, has_next = stage > 0, stage < p - 1
        counts = {kind: sum(op.kind == kind for op in ops) for kind in
                  (F, B, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, REDUCE_GRAD, OPTIMIZER_STEP)}
        assert counts == {F: m, B: m, RECV_ACT: m * has_previous, SEND_ACT: m * has_next,
                          RECV_GRAD: m * has_next, SEND_GRAD: m * has_previous,
                          REDUCE_GRAD: 1, OPTIMIZER_STEP: 1}
        assert ops[-2:] == [LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)]
        assert [Op(op.kind, op.micro_batch) for op in ops if op.kind in (F, B)] == schedule[stage]
        for op in ops:
            if op.kind in DIRECTION:
                assert op.peer == stage + DIRECTION[op.kind], (stage, op)
            else:
                assert op.peer is None, (stage, op)


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("p", range(1, 9))
def test_an_exchange_is_a_send_and_a_receive_with_one_peer_that_would_otherwise_come_one_by_one(name, p):
    for m in range(1, 17):
        _assert_exchanges_only_regroup(BUILDERS[name](p, m))


def _assert_exchanges_only_regroup(schedule):
    p = len(schedule)
    for stage, ops in enumerate(lower(schedule)):
        # only regrouped: the same sends and receives, in the same order
        assert unbatch(ops) == lowering._communicating(stage, schedule[stage], p) + ops[-2:]
        for index, op in enumerate(ops):
            if op.kind == EXCHANGE:
                send, recv = op.parts
                assert send.kind in (SEND_ACT, SEND_GRAD) and recv.kind in (RECV_ACT, RECV_GRAD)
                assert send.peer == recv.peer and op.micro_batch is op.peer is None
            elif op.kind in (SEND_ACT, SEND_GRAD):  # a lone send is never followed by a receive from its peer
                following = ops[index + 1]
                assert following.kind != EXCHANGE and following.peer != op.peer, (stage, ops)


def test_lowered_two_stage_gpipe_literally():
    act_to_1 = [LoweredOp(SEND_ACT, mb, 1) for mb in range(2)]
    grad_from_1 = [LoweredOp(RECV_GRAD, mb, 1) for mb in range(2)]
    act_from_0 = [LoweredOp(RECV_ACT, mb, 0) for mb in range(2)]
    grad_to_0 = [LoweredOp(SEND_GRAD, mb, 0) for mb in range(2)]
    collectives = [LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)]
    assert lower(gpipe_schedule(2, 2)) == [
        [LoweredOp(F, 0), act_to_1[0], LoweredOp(F, 1), exchange(act_to_1[1], grad_from_1[1]),
         LoweredOp(B, 1), grad_from_1[0], LoweredOp(B, 0)] + collectives,
        [act_from_0[0], LoweredOp(F, 0), act_from_0[1], LoweredOp(F, 1),
         LoweredOp(B, 1), grad_to_0[1], LoweredOp(B, 0), grad_to_0[0]] + collectives,
    ]


def test_lowered_two_stage_1f1b_pairs_each_send_with_the_receive_behind_it():
    # Megatron's send_forward_recv_backward on stage 0, send_backward_recv_forward on stage 1
    assert [[repr(op) for op in ops] for ops in lower(one_f_one_b_schedule(2, 3))] == [
        ["F0", "SEND_ACT0->1", "F1", "SEND_ACT1->1+RECV_GRAD0<-1", "B0", "F2", "SEND_ACT2->1+RECV_GRAD1<-1", "B1",
         "RECV_GRAD2<-1", "B2", "REDUCE_GRAD", "OPTIMIZER_STEP"],
        ["RECV_ACT0<-0", "F0", "B0", "SEND_GRAD0->0+RECV_ACT1<-0", "F1", "B1", "SEND_GRAD1->0+RECV_ACT2<-0", "F2", "B2",
         "SEND_GRAD2->0", "REDUCE_GRAD", "OPTIMIZER_STEP"],
    ]


def test_a_run_of_messages_is_batched_whole_when_it_sends_to_a_peer_it_receives_from():
    # as an interleaved schedule may have it: both neighbours in one run (Megatron's
    # send_forward_backward_recv_forward_backward); a run with no such peer stays as it is
    both = [LoweredOp(SEND_ACT, 0, 2), LoweredOp(SEND_GRAD, 1, 0), LoweredOp(RECV_ACT, 2, 0),
            LoweredOp(RECV_GRAD, 3, 2)]
    apart = [LoweredOp(SEND_ACT, 0, 2), LoweredOp(RECV_ACT, 1, 0)]
    assert lowering._batch_exchanges([LoweredOp(F, 0)] + both + [LoweredOp(B, 1)] + apart + [LoweredOp(F, 1)]) == (
        [LoweredOp(F, 0), exchange(*both), LoweredOp(B, 1)] + apart + [LoweredOp(F, 1)])


def test_lowered_ops_print_short():
    assert repr(LoweredOp(F, 3)) == "F3"
    assert repr(LoweredOp(SEND_ACT, 3, 1)) == "SEND_ACT3->1"
    assert repr(LoweredOp(RECV_GRAD, 2, 2)) == "RECV_GRAD2<-2"
    assert repr(LoweredOp(REDUCE_GRAD)) == "REDUCE_GRAD"
    assert repr(exchange(LoweredOp(SEND_ACT, 1, 1), LoweredOp(RECV_GRAD, 0, 1))) == "SEND_ACT1->1+RECV_GRAD0<-1"
    assert repr(lower([[Op(F, 0), Op(B, 0)]])) == "[[F0, B0, REDUCE_GRAD, OPTIMIZER_STEP]]"


def test_lowering_rejects_an_unknown_op_kind():
    with pytest.raises(ValueError, match="stage 0.*'X'"):
        lower([[Op("F", 0), Op("X", 0)]])


# Interleaved 1F1B under the rendezvous rule (a send holds its worker until its receive is posted). Each worker
# exchanges once per F and the B after it (Megatron's send_forward_backward_recv_forward_backward), so with
# messages that take no time the step is the schedule's own: (m*v + p - 1)(f + b), f and b a chunk's F and B,
# what buffered sends give. Before, the receives were placed as for the split backward (even-cost times) and a
# worker waited on a neighbour busy computing: at p = 8, m = 16, v = 2 (f = 1, b = 2) 139 against 117 units,
# longer than 1F1B's 138.
INTERLEAVED_SIZES = [(p, m, v) for p in (2, 3, 4, 5, 8) for m in (p, 2 * p, 4 * p) for v in (2, 3, 4)]


@pytest.mark.parametrize("forward,backward", [(1, 2), (1, 3)])
@pytest.mark.parametrize("p,m,v", INTERLEAVED_SIZES)
def test_interleaved_takes_the_schedules_own_time_under_the_rendezvous_rule(p, m, v, forward, backward):
    lowered = lower(interleaved_1f1b_schedule(p, m, v))
    times = {F: forward, B: backward}
    rendezvous = simulate_timed(lowered, times)
    assert rendezvous.step_s == (m * v + p - 1) * (forward + backward)
    assert rendezvous.step_s == simulate_timed(lowered, times, buffered_sends=True).step_s


def test_interleaved_workers_exchange_once_per_forward_and_the_backward_after_it():
    # p = 2, m = 4, v = 2, worker 1 in its steady state: F2 and B0 take their inputs in one exchange before F2 and
    # send their outputs in one after B0, which also takes the next pair's inputs
    worker = [repr(op) for op in lower(interleaved_1f1b_schedule(2, 4, 2))[1]]
    at = worker.index("F2")
    assert worker[at - 1:at + 3] == ["SEND_GRAD1c1->0+RECV_ACT2<-0+RECV_GRAD0<-0", "F2", "B0",
                                     "SEND_ACT2->0+SEND_GRAD0->0+RECV_ACT3<-0+RECV_GRAD1<-0"]


def test_a_forward_pairs_with_the_backward_after_it_unless_the_next_worker_would_wait_for_the_pair():
    # p = 2, m = 2: worker 0 runs its four forwards, then its backwards; worker 1 needs F1c1's activation right
    # after it made B0c1's gradient, so worker 0 runs F1c1 and B0c1 one by one. Worker 1's chunk 1 is the last
    # virtual stage (no activation out, no gradient in): its F and B pair.
    assert lowering._forward_backward_pairs(interleaved_1f1b_schedule(2, 2, 2), 2, 2, LOOPED) == [set(), {2, 4}]
    for p, m, v in [(3, 3, 2), (4, 4, 2), (4, 8, 3), (8, 16, 2)]:
        schedule = interleaved_1f1b_schedule(p, m, v)
        pairs = lowering._forward_backward_pairs(schedule, p, v, LOOPED)
        alternating = [{index for index in range(len(ops) - 1) if (ops[index].kind, ops[index + 1].kind) == (F, B)}
                       for ops in schedule]
        # from m = 2p on, every worker's every F followed by a B pairs; at m = p the forwards-first workers'
        # last F does not (the odd p's middle worker alternates once and pairs)
        unpaired = [sorted(candidates - paired) for candidates, paired in zip(alternating, pairs)]
        assert unpaired == {(3, 3, 2): [[5], [], []], (4, 4, 2): [[7], [7], [], []]}.get((p, m, v), [[]] * p)
        simulate(lower(schedule))


def test_the_lowerings_of_one_chunk_per_worker_are_those_before_the_interleaved_pairs():
    # gpipe, 1f1b and zb_h1 at p 2..8, m 1..20, byte for byte as lowered before interleaved_1f1b's pairs (56d1f1f)
    digest = hashlib.sha256()
    for name, build in (("gpipe", gpipe_schedule), ("1f1b", one_f_one_b_schedule), ("zb_h1", zb_h1_schedule)):
        for p in range(2, 9):
            for m in range(1, 21):
                digest.update(f"{name} {p} {m} {lower(build(p, m))!r}\n".encode())
    assert digest.hexdigest() == "cb1e35b6db5b35afd7f6365cfd375e0cc5aea392f6031a248d69940a14b08317"
