"""Re-partitioning onto fewer stages: the predicted memory of merged stages, and
the most stages that fit the room there is."""
from raypipe.core.result import StageStats
from raypipe.planning.repartition import fewer_stages, layer_bytes


def test_merged_stages_add_up_what_their_layers_measured():
    stats = [StageStats(stage=0, optimizer_bytes=80, held_for_backward_bytes=20),
             StageStats(stage=1, optimizer_bytes=0, held_for_backward_bytes=30)]
    predicted = layer_bytes([[0, 1], [2, 3]], [10, 30, 0, 0], stats)
    # stage 0: 2 x parameters + its 100 shared bytes by parameter share; stage 1 has no parameters: even shares
    assert predicted == [20 + 25, 60 + 75, 15, 15]
    assert sum(predicted) == 2 * 40 + 100 + 30


def test_the_most_stages_below_now_that_are_placeable_and_fit():
    costs, predicted = [1, 1, 1, 1], [10.0, 10.0, 10.0, 10.0]
    assert fewer_stages(costs, predicted, below=4, placeable=8, capacity_bytes=40) == [1, 1, 2]
    assert fewer_stages(costs, predicted, below=4, placeable=2, capacity_bytes=40) == [2, 2]
    assert fewer_stages(costs, predicted, below=2, placeable=8, capacity_bytes=40) == [4]
    assert fewer_stages(costs, predicted, below=4, placeable=1, capacity_bytes=39) is None  # one stage needs 40
    assert fewer_stages(costs, predicted, below=4, placeable=0, capacity_bytes=1e9) is None
