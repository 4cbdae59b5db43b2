"""Lowering a compute schedule adds the sends, receives and collectives: pure data, no Ray or torch."""
import pytest

from raypipe.core.lowering import lower
from raypipe.core.ops import (B, F, OPTIMIZER_STEP, RECV_ACT, RECV_GRAD, REDUCE_GRAD, SEND_ACT, SEND_GRAD, LoweredOp,
                              Op)
from raypipe.core.schedule import gpipe_schedule, one_f_one_b_schedule

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
    for stage, ops in enumerate(lowered):
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


def test_lowered_two_stage_gpipe_literally():
    act_to_1 = [LoweredOp(SEND_ACT, mb, 1) for mb in range(2)]
    grad_from_1 = [LoweredOp(RECV_GRAD, mb, 1) for mb in range(2)]
    act_from_0 = [LoweredOp(RECV_ACT, mb, 0) for mb in range(2)]
    grad_to_0 = [LoweredOp(SEND_GRAD, mb, 0) for mb in range(2)]
    collectives = [LoweredOp(REDUCE_GRAD), LoweredOp(OPTIMIZER_STEP)]
    assert lower(gpipe_schedule(2, 2)) == [
        [LoweredOp(F, 0), act_to_1[0], LoweredOp(F, 1), act_to_1[1],
         grad_from_1[1], LoweredOp(B, 1), grad_from_1[0], LoweredOp(B, 0)] + collectives,
        [act_from_0[0], LoweredOp(F, 0), act_from_0[1], LoweredOp(F, 1),
         LoweredOp(B, 1), grad_to_0[1], LoweredOp(B, 0), grad_to_0[0]] + collectives,
    ]


def test_lowered_ops_print_short():
    assert repr(LoweredOp(F, 3)) == "F3"
    assert repr(LoweredOp(SEND_ACT, 3, 1)) == "SEND_ACT3->1"
    assert repr(LoweredOp(RECV_GRAD, 2, 2)) == "RECV_GRAD2<-2"
    assert repr(LoweredOp(REDUCE_GRAD)) == "REDUCE_GRAD"
    assert repr(lower([[Op(F, 0), Op(B, 0)]])) == "[[F0, B0, REDUCE_GRAD, OPTIMIZER_STEP]]"


def test_lowering_rejects_an_unknown_op_kind():
    with pytest.raises(ValueError, match="stage 0.*'W'"):
        lower([[Op("F", 0), Op("W", 0)]])
