"""The dry-run simulator of lowered schedules: no Ray or torch, so it runs in milliseconds."""
import re
import subprocess
import sys
from collections import defaultdict

import pytest

import raypipe.core.schedule as schedule_module
from raypipe.core import lowering
from raypipe.core.lowering import lower
from raypipe.core.ops import (B, EXCHANGE, F, OPTIMIZER_STEP, RECV_ACT, RECV_GRAD, REDUCE_GRAD, SEND_ACT, SEND_GRAD,
                              LoweredOp, Op, exchange, unbatch)
from raypipe.core.schedule import make_schedule, one_f_one_b_schedule
from raypipe.core.simulator import ScheduleError, simulate

SIZES = [(p, m) for p in range(1, 9) for m in range(1, 17)]
COLLECTIVES = (REDUCE_GRAD, OPTIMIZER_STEP)
SENDS, RECEIVES = (SEND_ACT, SEND_GRAD), (RECV_ACT, RECV_GRAD)


def unpaired(schedule):
    """The lowering as it was before sends and receives were paired: each alone, in
    the order its compute op implies (what NCCL deadlocks on in 1F1B)."""
    return [lowering._communicating(stage, ops, len(schedule)) + [LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)]
            for stage, ops in enumerate(schedule)]


def messages(lowered):
    """Per (sender, receiver): the sends and the receives, each as (index of its op in
    its stage, the part), in issue order."""
    sends, receives = defaultdict(list), defaultdict(list)
    for stage, ops in enumerate(lowered):
        for index, op in enumerate(ops):
            for part in (op.parts if op.kind == EXCHANGE else (op,)):
                if part.kind in SENDS:
                    sends[(stage, part.peer)].append((index, part))
                elif part.kind in RECEIVES:
                    receives[(part.peer, stage)].append((index, part))
    return sends, receives


def assert_valid_order(lowered, order):
    """Independent of the simulator: ``order`` keeps each stage's order; between two
    stages the k-th send meets the k-th receive, of the same kind and micro-batch; an op
    completes only after every op it exchanges a message with was posted (the other
    stage ran all its ops before that one: the rendezvous rule); and each collective
    starts only after every stage has run all its ops before that collective."""
    assert len(order) == sum(len(ops) for ops in lowered)
    for stage, ops in enumerate(lowered):
        assert [op for s, op in order if s == stage] == ops
    completed = {}  # (stage, index of op in its stage) -> index in order
    seen = defaultdict(int)
    for position, (stage, _) in enumerate(order):
        completed[(stage, seen[stage])] = position
        seen[stage] += 1

    def posted(stage, index):  # when the stage got to that op: once the op before it completed
        return completed[(stage, index - 1)] if index > 0 else -1

    sends, receives = messages(lowered)
    assert sends.keys() == receives.keys()
    for (sender, receiver), sent in sends.items():
        received = receives[(sender, receiver)]
        assert len(sent) == len(received)
        for (send_index, send), (recv_index, recv) in zip(sent, received):
            assert (send.kind.replace("SEND", "RECV"), send.micro_batch) == (recv.kind, recv.micro_batch)
            assert completed[(sender, send_index)] > posted(receiver, recv_index), (send, recv)
            assert completed[(receiver, recv_index)] > posted(sender, send_index), (send, recv)
    _assert_collectives_wait_for_every_stage(lowered, order)


def _assert_collectives_wait_for_every_stage(lowered, order):
    position = {}  # (stage, index of op in its stage) -> index in order
    seen = defaultdict(int)
    for index, (stage, _) in enumerate(order):
        position[(stage, seen[stage])] = index
        seen[stage] += 1
    collective_indices = [[i for i, op in enumerate(ops) if op.kind in COLLECTIVES] for ops in lowered]
    for nth in range(len(collective_indices[0])):
        start = min(position[(stage, indices[nth])] for stage, indices in enumerate(collective_indices))
        for stage, indices in enumerate(collective_indices):
            assert all(position[(stage, i)] < start for i in range(indices[nth]))


def runs_with_buffered_sends(lowered):
    """A reference interpreter of the model the simulator used to have: sends never
    block, a receive waits for its send. True when every stage gets to its end."""
    lowered = [unbatch(ops) for ops in lowered]  # an exchange: its sends, then its receives
    position, in_flight = [0] * len(lowered), defaultdict(list)
    progressed = True
    while progressed:
        progressed = False
        for stage, ops in enumerate(lowered):
            while position[stage] < len(ops):
                op = ops[position[stage]]
                if op.kind in SENDS:
                    in_flight[(stage, op.peer)].append(op.micro_batch)
                elif op.kind in RECEIVES:
                    if not in_flight[(op.peer, stage)]:
                        break
                    assert in_flight[(op.peer, stage)].pop(0) == op.micro_batch
                elif op.kind in COLLECTIVES:
                    break
                position[stage] += 1
                progressed = True
        at_collective = [ops[position[s]].kind if position[s] < len(ops) else None for s, ops in enumerate(lowered)]
        if at_collective[0] in COLLECTIVES and len(set(at_collective)) == 1:
            position = [place + 1 for place in position]
            progressed = True
    return all(place == len(ops) for place, ops in zip(position, lowered))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])  # the others (chunks, I and W): tests/core/test_new_schedules.py
@pytest.mark.parametrize("p", range(1, 9))
def test_every_schedule_lowers_and_runs_in_a_valid_order_under_the_rendezvous_rule(name, p):
    for m in range(1, 17):
        lowered = lower(make_schedule(name, p, m))
        assert_valid_order(lowered, simulate(lowered))


def test_the_unpaired_1f1b_order_deadlocks_under_the_rendezvous_rule_and_the_paired_one_runs():
    # today's 1F1B at p=2 before pairing: stage 0 sends a1 before receiving g0 while
    # stage 1 sends g0 before receiving a1; each send waits for a receive behind the other send
    before = [[LoweredOp(F, 0), LoweredOp(SEND_ACT, 0, 1), LoweredOp(F, 1), LoweredOp(SEND_ACT, 1, 1),
               LoweredOp(RECV_GRAD, 0, 1), LoweredOp(B, 0), LoweredOp(RECV_GRAD, 1, 1), LoweredOp(B, 1)],
              [LoweredOp(RECV_ACT, 0, 0), LoweredOp(F, 0), LoweredOp(B, 0), LoweredOp(SEND_GRAD, 0, 0),
               LoweredOp(RECV_ACT, 1, 0), LoweredOp(F, 1), LoweredOp(B, 1), LoweredOp(SEND_GRAD, 1, 0)]]
    before = [ops + [LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)] for ops in before]
    assert before == unpaired(one_f_one_b_schedule(2, 2))
    assert runs_with_buffered_sends(before)  # so the deadlock is the rendezvous rule's alone
    expected = ("deadlock: stage 0 waits on SEND_ACT1->1; stage 1 waits on SEND_GRAD0->0 "
                "(a send completes only once its receive is posted")
    with pytest.raises(ScheduleError, match=re.escape(expected)):
        simulate(before)

    after = lower(one_f_one_b_schedule(2, 2))
    assert [repr(op) for op in after[0] if op.kind == EXCHANGE] == ["SEND_ACT1->1+RECV_GRAD0<-1"]
    assert [repr(op) for op in after[1] if op.kind == EXCHANGE] == ["SEND_GRAD0->0+RECV_ACT1<-0"]
    assert_valid_order(after, simulate(after))


@pytest.mark.parametrize("p", range(2, 9))
def test_every_unpaired_1f1b_with_a_steady_state_is_refused_though_buffered_sends_would_run_it(p):
    for m in range(2, 17):
        before = unpaired(one_f_one_b_schedule(p, m))
        assert runs_with_buffered_sends(before)
        with pytest.raises(ScheduleError, match=r"^deadlock: .*waits on SEND_"):
            simulate(before)


def test_a_hand_written_exchange_between_two_waiting_sends_runs():
    # pairing one side is enough at p=2: stage 0's exchange posts the receive stage 1's send waits for
    lowered = unpaired(one_f_one_b_schedule(2, 2))
    lowered[0][3:5] = [exchange(lowered[0][3], lowered[0][4])]
    assert_valid_order(lowered, simulate(lowered))


def test_a_middle_pair_left_unpaired_deadlocks_and_is_named():
    # 1F1B on three stages with stages 1 and 2 sending and receiving one by one again
    # (stage 0 keeps its exchanges with stage 1): only that pair waits on each other
    lowered = lower(one_f_one_b_schedule(3, 3))
    for stage in (1, 2):
        lowered[stage] = [part for op in lowered[stage] for part in
                          (op.parts if op.kind == EXCHANGE and {p.peer for p in op.parts} == {3 - stage} else (op,))]
    assert runs_with_buffered_sends(lowered)
    with pytest.raises(ScheduleError, match=r"^deadlock: stage 0 waits on .*stage 1 waits on SEND_ACT1->2; "
                                            r"stage 2 waits on SEND_GRAD0->1 \(a send completes"):
        simulate(lowered)


def test_simulate_is_round_robin_over_stages():
    order = simulate(lower(make_schedule("gpipe", 2, 2)))
    assert [(stage, repr(op)) for stage, op in order[:5]] == [
        (0, "F0"), (0, "SEND_ACT0->1"), (1, "RECV_ACT0<-0"), (0, "F1"), (1, "F0")]
    assert [(stage, repr(op)) for stage, op in order[-4:]] == [
        (0, "REDUCE_GRAD"), (1, "REDUCE_GRAD"), (0, "OPTIMIZER_STEP"), (1, "OPTIMIZER_STEP")]


def test_a_receive_before_the_send_it_waits_for_deadlocks():
    lowered = unpaired(make_schedule("gpipe", 2, 1))
    assert [repr(op) for op in lowered[0][1:3]] == ["SEND_ACT0->1", "RECV_GRAD0<-1"]
    lowered[0][1:3] = lowered[0][2], lowered[0][1]
    expected = "deadlock: stage 0 waits on RECV_GRAD0<-1; stage 1 waits on RECV_ACT0<-0"
    with pytest.raises(ScheduleError, match=re.escape(expected)):
        simulate(lowered)


def test_receiving_micro_batches_out_of_send_order_is_a_mismatch():
    lowered = lower(make_schedule("gpipe", 2, 2))
    receives = [op for op in lowered[1] if op.kind == RECV_ACT]
    assert receives == [LoweredOp(RECV_ACT, 0, 0), LoweredOp(RECV_ACT, 1, 0)]
    computes = [op for op in lowered[1] if op.kind != RECV_ACT]
    lowered[1] = receives[::-1] + computes  # still receives before it computes, but 1 then 0
    expected = ("mismatch: stage 1 runs RECV_ACT1<-0 but the message it meets, stage 0's next in issue order, "
                "is SEND_ACT0->1 (micro-batch 0, not 1)")
    with pytest.raises(ScheduleError, match=re.escape(expected)):
        simulate(lowered)


@pytest.mark.parametrize("dropped,expected", [
    (REDUCE_GRAD, "stage 0 waits on REDUCE_GRAD; stage 1 waits on OPTIMIZER_STEP"),
    (OPTIMIZER_STEP, "stage 0 waits on OPTIMIZER_STEP; stage 1 has finished"),
])
def test_a_collective_missing_on_one_stage_deadlocks(dropped, expected):
    lowered = lower(make_schedule("1f1b", 2, 2))
    lowered[1] = [op for op in lowered[1] if op.kind != dropped]
    with pytest.raises(ScheduleError, match="deadlock: " + re.escape(expected)):
        simulate(lowered)


@pytest.mark.parametrize("schedule,message", [
    ([[Op("B", 0), Op("F", 0)], [Op("F", 0), Op("B", 0)]], "stage 0: B0 runs before F0"),
    ([[Op("F", 0), Op("F", 1), Op("B", 1), Op("B", 0)], [Op("F", 0), Op("B", 0)]], "stage 1: F1 is missing"),
    ([[Op("F", 0), Op("B", 0)], [Op("F", 0), Op("F", 0), Op("B", 0)]], "stage 1: F0 runs twice"),
    ([[Op("F", 0), Op("F", 5), Op("B", 5), Op("B", 0)], [Op("F", 0), Op("F", 1), Op("B", 1), Op("B", 0)]],
     "stage 0: F5 has a micro-batch outside 0..2"),
])
def test_compute_ops_out_of_place_are_caught(schedule, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        simulate(lower(schedule))


def test_a_compute_op_before_the_receive_of_its_input_is_caught():
    lowered = lower(make_schedule("gpipe", 2, 1))
    lowered[1][0:2] = lowered[1][1], lowered[1][0]
    with pytest.raises(ScheduleError, match=re.escape("stage 1: F0 runs before RECV_ACT0<-0")):
        simulate(lowered)


@pytest.mark.parametrize("stage,index,op,message", [
    (2, 0, LoweredOp(RECV_ACT, 0, 0), "stage 2: RECV_ACT0<-0 must have peer 1"),
    (0, 0, LoweredOp(RECV_ACT, 0, 1), "stage 0: RECV_ACT0<-1 has no neighbour"),
    (1, 0, LoweredOp("RECV_WEIGHTS", 0, 0), "stage 1: unknown op kind 'RECV_WEIGHTS'"),
])
def test_ops_with_a_wrong_peer_or_kind_are_caught(stage, index, op, message):
    lowered = lower(make_schedule("gpipe", 3, 1))
    lowered[stage].insert(index, op)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        simulate(lowered)


@pytest.mark.parametrize("stage,index,message", [
    (0, 1, "stage 0 runs SEND_ACT0->1 but stage 1 never receives it (2 sends to it, 1 receives)"),
    (1, 0, "stage 1 runs RECV_ACT0<-0 but stage 0 never sends it (2 receives from it, 1 sends)"),
])
def test_a_message_never_received_or_never_sent_is_caught(stage, index, message):
    lowered = lower(make_schedule("gpipe", 2, 1))
    assert repr(lowered[0][1]) == "SEND_ACT0->1+RECV_GRAD0<-1"
    lowered[stage].insert(index, LoweredOp(SEND_ACT, 0, 1) if stage == 0 else LoweredOp(RECV_ACT, 0, 0))
    with pytest.raises(ScheduleError, match=re.escape(message)):
        simulate(lowered)


@pytest.mark.parametrize("parts,message", [
    ((), "stage 0: an EXCHANGE holds one or more sends and receives, not []"),
    ((LoweredOp(SEND_ACT, 0, 1), LoweredOp(F, 0)), "not [SEND_ACT0->1, F0]"),
    ((LoweredOp(SEND_ACT, 0, 2),), "stage 0: SEND_ACT0->2 must have peer 1"),
])
def test_a_malformed_exchange_is_caught(parts, message):
    lowered = lower(make_schedule("gpipe", 2, 1))
    lowered[0][1] = exchange(*parts)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        simulate(lowered)


def test_an_exchange_whose_send_comes_before_its_tensor_is_caught():
    lowered = lower(make_schedule("gpipe", 2, 1))
    lowered[0][0:2] = lowered[0][1], lowered[0][0]
    with pytest.raises(ScheduleError, match=re.escape("stage 0: SEND_ACT0->1 runs before F0, which it needs")):
        simulate(lowered)


@pytest.mark.parametrize("name,builder", [("gpipe", "gpipe_schedule"), ("1f1b", "one_f_one_b_schedule")])
def test_make_schedule_rejects_a_broken_schedule(monkeypatch, name, builder):
    def broken(num_stages, num_micro_batches):
        return [[Op("B", 0), Op("F", 0)]] + [[Op("F", 0), Op("B", 0)]] * (num_stages - 1)

    monkeypatch.setattr(schedule_module, builder, broken)
    with pytest.raises(ScheduleError, match="stage 0: B0 runs before F0"):
        make_schedule(name, 2, 1)


def test_lowering_and_simulator_need_neither_ray_nor_torch_and_import_in_any_order():
    code = ("import sys, raypipe.core.simulator; "
            "from raypipe.core.schedule import Op, make_schedule, SCHEDULES; "
            "make_schedule('1f1b', 3, 4); "
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
def test_every_schedule_runs_in_a_valid_order_with_learned_boundary_signatures(name):
    """Once every signature is learned no header goes and an exchange posts all its parts at once
    (``boundary_shapes="learned"``): the lowering made for the steps with headers runs that way too."""
    from raypipe.core.schedule import PLACEMENT

    for p, m in ((2, 4), (3, 6), (4, 8)):
        v = 2 if name in ("interleaved_1f1b", "zbv") else 1
        lowered = lower(make_schedule(name, p, m, v), PLACEMENT[name])
        assert_valid_order(lowered, simulate(lowered, PLACEMENT[name], boundary_shapes="learned"))
