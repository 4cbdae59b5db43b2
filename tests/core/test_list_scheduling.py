"""ZB-V's list-scheduled order (raypipe.core.list_scheduling) and where zbv_schedule takes it over the
paper's V: checked against the timed simulator and the work bound, no Ray."""
from __future__ import annotations

from collections import Counter

import pytest

from raypipe.core.list_scheduling import list_scheduled_zbv
from raypipe.core.lowering import lower
from raypipe.core.ops import EXCHANGE, F, I, W
from raypipe.core.schedule import PLACEMENT, dry_run, max_in_flight, v_shaped_zbv, zbv_schedule
from raypipe.core.simulator import postings
from raypipe.core.timed_simulation import simulate_timed

UNIT = {F: 1.0, I: 1.0, W: 1.0}
V = PLACEMENT["zbv"]


def unit_step(schedule) -> float:
    return simulate_timed(lower(schedule, V), UNIT, placement=V).step_s


def work_bound(p: int, m: int) -> int:
    """6m chunk ops on every worker, the last of which starts p - 1 units late."""
    return 6 * m + p - 1


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
def test_a_list_scheduled_order_runs_every_op_once_in_order_within_the_vs_memory(p):
    for m in range(1, 2 * p + 1):
        schedule, step = list_scheduled_zbv(p, m)
        dry_run(schedule, V)  # it runs under the rendezvous rule
        assert unit_step(schedule) == step, m  # the step it gives is the timed simulator's
        for ops in schedule:
            assert Counter((op.kind, op.chunk) for op in ops) == Counter(
                {(kind, chunk): m for kind in (F, I, W) for chunk in (0, 1)})
            for kind in (F, I, W):
                for chunk in (0, 1):
                    assert [op.micro_batch for op in ops if (op.kind, op.chunk) == (kind, chunk)] == list(range(m))
        assert max(max_in_flight(schedule)) <= 2 * p, m


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
def test_zbv_takes_the_shorter_order_and_no_order_beats_the_work_bound(p):
    for m in range(1, 2 * p + 2):
        v_shaped = unit_step(v_shaped_zbv(p, m))
        assert v_shaped == max(work_bound(p, m), 4 * (m + p) - 2), m  # the V's step; the bound's from 2m >= 3p - 1
        chosen = unit_step(zbv_schedule(p, m))
        assert work_bound(p, m) <= chosen <= v_shaped, m
        if 2 * m >= 3 * p - 1:
            assert zbv_schedule(p, m) == v_shaped_zbv(p, m), m  # the V is kept where it reaches the bound
        else:
            assert chosen == min(v_shaped, list_scheduled_zbv(p, m)[1]), m


def test_at_p_8_m_8_zbv_reaches_the_work_bound_where_the_v_leaves_zb_h1s_bubble():
    p, m = 8, 8
    assert unit_step(v_shaped_zbv(p, m)) == 62
    run = simulate_timed(lower(zbv_schedule(p, m), V), UNIT, placement=V)
    assert run.step_s == work_bound(p, m) == 55
    assert run.bubble_fraction == pytest.approx([7 / 55] * p)


def test_an_exchange_of_receives_alone_is_timed_as_it_posts():
    """At p = 5, m = 9 (where zbv keeps the V) the list-scheduled order lowers to an EXCHANGE of two
    activation receives, both received after an empty batch: the timed simulation completes that batch
    as it is posted."""
    schedule, step = list_scheduled_zbv(5, 9)
    lowered = lower(schedule, V)
    assert any(op.kind == EXCHANGE and not postings(op)[0].parts for ops in lowered for op in ops)
    assert simulate_timed(lowered, UNIT, placement=V).step_s == step
    assert simulate_timed(lowered, UNIT, placement=V, buffered_sends=True).step_s == step
