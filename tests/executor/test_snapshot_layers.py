"""Which snapshots a worker of another partition adopts: those holding its layers."""
import pytest

from raypipe.core.partition import stage_layer_ranges
from raypipe.control.snapshots import holding


def layers_of(balance):
    return [tuple(indices) for indices in stage_layer_ranges(balance)]


@pytest.mark.parametrize(("old", "new", "expected"), [
    ([3, 4], [7], [["s0", "s1"]]),  # onto fewer stages: the one stage needs both
    ([7], [3, 4], [["s0"], ["s0"]]),  # back: each stage's layers are in the one snapshot
    ([3, 4], [3, 4], [["s0"], ["s1"]]),  # the same partition: each its own stage's
    ([2, 2, 3], [3, 4], [["s0", "s1"], ["s1", "s2"]]),  # a new stage spans the old stages it overlaps
])
def test_a_worker_adopts_only_the_snapshots_that_hold_its_layers(old, new, expected):
    refs = [f"s{stage}" for stage in range(len(old))]
    assert [holding(refs, layers_of(old), wanted) for wanted in layers_of(new)] == expected


def test_every_replica_holding_a_layer_is_adopted_and_a_mismatch_is_an_error():
    layers = layers_of([3, 4]) * 2  # two replicas of two stages, as taken (replica-major)
    assert holding(["r0s0", "r0s1", "r1s0", "r1s1"], layers, (2, 3)) == ["r0s0", "r0s1", "r1s0", "r1s1"]
    assert holding(["r0s0", "r0s1", "r1s0", "r1s1"], layers, (0,)) == ["r0s0", "r1s0"]
    with pytest.raises(ValueError):
        holding(["s0"], layers, (0,))
