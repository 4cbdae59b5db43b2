"""The dry-run simulator of lowered schedules: no Ray or torch, so it runs in milliseconds."""
import re
import subprocess
import sys
from collections import defaultdict

import pytest

import raypipe.core.schedule as schedule_module
from raypipe.core.lowering import lower
from raypipe.core.ops import OPTIMIZER_STEP, RECV_ACT, REDUCE_GRAD, LoweredOp, Op
from raypipe.core.schedule import make_schedule
from raypipe.core.simulator import ScheduleError, simulate

SIZES = [(p, m) for p in range(1, 5) for m in range(1, 9)]
COLLECTIVES = (REDUCE_GRAD, OPTIMIZER_STEP)


def assert_valid_order(lowered, order):
    """Independent of the simulator: ``order`` keeps each stage's order, every RECV
    comes after the SEND it pairs with in FIFO order, and each collective starts
    only after every stage has run all its ops before that collective."""
    assert len(order) == sum(len(ops) for ops in lowered)
    for stage, ops in enumerate(lowered):
        assert [op for s, op in order if s == stage] == ops
    sent = defaultdict(list)  # (sender, receiver, "ACT" or "GRAD") -> micro-batches, in send order
    received = defaultdict(int)
    for stage, op in order:
        direction, _, payload = op.kind.partition("_")
        if direction == "SEND":
            sent[(stage, op.peer, payload)].append(op.micro_batch)
        elif direction == "RECV":
            channel = (op.peer, stage, payload)
            assert received[channel] < len(sent[channel]), f"stage {stage} ran {op!r} before its send"
            assert sent[channel][received[channel]] == op.micro_batch
            received[channel] += 1
    assert all(received[channel] == len(mbs) for channel, mbs in sent.items())
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


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SIZES)
def test_simulate_runs_gpipe_and_1f1b_in_a_valid_order(name, p, m):
    lowered = lower(make_schedule(name, p, m))
    assert_valid_order(lowered, simulate(lowered))


def test_simulate_is_round_robin_over_stages():
    order = simulate(lower(make_schedule("gpipe", 2, 2)))
    assert [(stage, repr(op)) for stage, op in order[:5]] == [
        (0, "F0"), (0, "SEND_ACT0->1"), (1, "RECV_ACT0<-0"), (0, "F1"), (1, "F0")]
    assert [(stage, repr(op)) for stage, op in order[-4:]] == [
        (0, "REDUCE_GRAD"), (1, "REDUCE_GRAD"), (0, "OPTIMIZER_STEP"), (1, "OPTIMIZER_STEP")]


def test_a_receive_before_the_send_it_waits_for_deadlocks():
    lowered = lower(make_schedule("gpipe", 2, 1))
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
    with pytest.raises(ScheduleError, match=r"mismatch: stage 1 runs RECV_ACT1<-0 .*stage 0 is its SEND_ACT0->1"):
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


def test_a_message_never_received_is_caught():
    lowered = lower(make_schedule("gpipe", 2, 1))
    lowered[0].insert(2, lowered[0][1])  # SEND_ACT0->1 twice
    with pytest.raises(ScheduleError, match=re.escape("stage 0 ran SEND_ACT0->1 but stage 1 never received it")):
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
