"""Schedules are pure data: tested without Ray or torch."""
import sys

import pytest

from raypipe.core.partition import partition_by_cost, stage_layer_ranges
from raypipe.core.schedule import Op, bubble_fraction, gpipe_schedule, make_schedule, max_in_flight, one_f_one_b_schedule


def test_schedule_module_needs_neither_ray_nor_torch():
    import subprocess

    code = ("import sys, raypipe.core.schedule, raypipe.core.partition; "
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpipe_is_all_forwards_then_backwards_in_reverse():
    schedule = gpipe_schedule(3, 4)
    assert len(schedule) == 3
    for ops in schedule:
        assert ops == [Op("F", 0), Op("F", 1), Op("F", 2), Op("F", 3),
                       Op("B", 3), Op("B", 2), Op("B", 1), Op("B", 0)]


def test_1f1b_limits_in_flight_micro_batches():
    schedule = one_f_one_b_schedule(4, 8)
    assert max_in_flight(schedule) == [4, 3, 2, 1]
    assert max_in_flight(gpipe_schedule(4, 8)) == [8, 8, 8, 8]
    for ops in schedule:
        assert sorted(op for op in ops if op.kind == "F") == [Op("F", mb) for mb in range(8)]
        assert [op.micro_batch for op in ops if op.kind == "B"] == list(range(8))


@pytest.mark.parametrize("p,m,expected", [(1, 4, 0.0), (2, 8, 1 / 9), (4, 4, 3 / 7), (8, 32, 7 / 39)])
def test_bubble_fraction(p, m, expected):
    assert bubble_fraction(p, m) == pytest.approx(expected)


def test_bubble_fraction_matches_a_simulated_gpipe_step():
    # unit-time F and B, each stage waits for its neighbour: the idle share is (p-1)/(m+p-1)
    p, m = 3, 5
    finish_f = [[0] * m for _ in range(p)]
    for s in range(p):
        for mb in range(m):
            ready = max(finish_f[s][mb - 1] if mb else 0, finish_f[s - 1][mb] if s else 0)
            finish_f[s][mb] = ready + 1
    last_f = finish_f[p - 1][m - 1]
    window = 2 * last_f  # backward mirrors forward
    assert 1 - (2 * m) / window == pytest.approx(bubble_fraction(p, m))


@pytest.mark.parametrize("bad", [(0, 1), (1, 0)])
def test_schedule_sizes_are_checked(bad):
    with pytest.raises(ValueError):
        gpipe_schedule(*bad)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zigzag", 2, 2)


def test_partition_balances_cost_and_keeps_every_stage_non_empty():
    assert partition_by_cost([1] * 8, 2) == [4, 4]
    assert partition_by_cost([10, 1, 1, 1, 1, 1, 1, 10], 3) == [1, 6, 1]
    assert partition_by_cost([0, 0, 0], 3) == [1, 1, 1]
    sizes = partition_by_cost([3, 1, 4, 1, 5, 9, 2, 6], 3)
    assert sum(sizes) == 8 and min(sizes) >= 1
    starts = [r.start for r in stage_layer_ranges(sizes)]
    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    worst = max(sum(costs[r.start:r.stop]) for r in stage_layer_ranges(sizes))
    # brute force over all cut points gives the same optimum
    import itertools
    best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (8,)))
               for cuts in itertools.combinations(range(1, 8), 2))
    assert worst == best and starts[0] == 0
    with pytest.raises(ValueError):
        partition_by_cost([1, 1], 3)
