"""Topology: ranks, coordinates and groups of a DP x PP layout."""
import pytest

from raypipe import ConfigError
from raypipe.core.topology import Topology, WorkerCoordinates


def test_ranks_are_replica_major_and_round_trip():
    topology = Topology(num_stages=3, num_replicas=2)
    assert topology.world_size == 6
    assert [topology.coordinates(rank) for rank in range(6)] == [
        WorkerCoordinates(0, 0), WorkerCoordinates(0, 1), WorkerCoordinates(0, 2),
        WorkerCoordinates(1, 0), WorkerCoordinates(1, 1), WorkerCoordinates(1, 2)]
    assert all(topology.rank(*topology.coordinates(rank)) == rank for rank in range(6))


def test_groups_of_a_pipeline_and_of_a_stage():
    topology = Topology(num_stages=3, num_replicas=2)
    assert topology.pipeline_ranks(1) == [3, 4, 5]
    assert topology.stage_ranks(2) == [2, 5]
    assert Topology(4).stage_ranks(3) == [3]


def test_bad_sizes_and_indices_are_named():
    with pytest.raises(ConfigError, match="num_stages"):
        Topology(num_stages=0)
    with pytest.raises(ConfigError, match="num_replicas"):
        Topology(num_stages=2, num_replicas=-1)
    with pytest.raises(IndexError, match="stage 2 is outside 0..1"):
        Topology(2).rank(0, 2)
    with pytest.raises(IndexError, match="rank 4 is outside 0..3"):
        Topology(2, 2).coordinates(4)


def enumerated(num_replicas: int, num_stages: int, tensor_parallel: int) -> list[tuple[int, int, int]]:
    """Every worker's (replica, stage, tp_rank), listed in rank order by plain nested loops:
    the reference the rank arithmetic is checked against."""
    return [(replica, stage, tp_rank) for replica in range(num_replicas) for stage in range(num_stages)
            for tp_rank in range(tensor_parallel)]


LAYOUTS = [(d, p, t) for d in (1, 2, 3) for p in (1, 2, 3) for t in (1, 2, 4)]


@pytest.mark.parametrize("num_replicas,num_stages,tensor_parallel", LAYOUTS)
def test_ranks_with_a_tensor_parallel_axis_match_an_enumeration(num_replicas, num_stages, tensor_parallel):
    topology = Topology(num_stages, num_replicas, tensor_parallel)
    workers = enumerated(num_replicas, num_stages, tensor_parallel)
    assert topology.world_size == len(workers)
    assert [tuple(topology.coordinates(rank)) for rank in range(topology.world_size)] == workers
    assert [topology.rank(*worker) for worker in workers] == list(range(len(workers)))
    assert all(isinstance(topology.coordinates(rank), WorkerCoordinates) for rank in range(len(workers)))


@pytest.mark.parametrize("num_replicas,num_stages,tensor_parallel", LAYOUTS)
def test_each_kind_of_group_holds_every_rank_exactly_once(num_replicas, num_stages, tensor_parallel):
    topology = Topology(num_stages, num_replicas, tensor_parallel)
    workers = enumerated(num_replicas, num_stages, tensor_parallel)
    rank_of = {worker: rank for rank, worker in enumerate(workers)}
    pipelines = [topology.pipeline_ranks(replica, tp_rank) for replica in range(num_replicas)
                 for tp_rank in range(tensor_parallel)]
    data_parallel = [topology.stage_ranks(stage, tp_rank) for stage in range(num_stages)
                     for tp_rank in range(tensor_parallel)]
    tensor_parallel_groups = [topology.tensor_ranks(replica, stage) for replica in range(num_replicas)
                              for stage in range(num_stages)]
    for groups in (pipelines, data_parallel, tensor_parallel_groups):
        assert sorted(rank for group in groups for rank in group) == list(range(len(workers)))
    # what each group is, from the enumeration: a pipeline shares (replica, tp_rank) and runs
    # through the stages in order; a data-parallel group shares (stage, tp_rank); a
    # tensor-parallel group shares (replica, stage) and runs through the tp_ranks in order
    for replica in range(num_replicas):
        for tp_rank in range(tensor_parallel):
            assert topology.pipeline_ranks(replica, tp_rank) == [rank_of[replica, stage, tp_rank]
                                                                 for stage in range(num_stages)]
        for stage in range(num_stages):
            assert topology.tensor_ranks(replica, stage) == [rank_of[replica, stage, tp_rank]
                                                             for tp_rank in range(tensor_parallel)]
    for stage in range(num_stages):
        for tp_rank in range(tensor_parallel):
            assert topology.stage_ranks(stage, tp_rank) == [rank_of[replica, stage, tp_rank]
                                                            for replica in range(num_replicas)]


@pytest.mark.parametrize("tensor_parallel", [1, 2, 4])
def test_a_stages_tensor_parallel_workers_are_adjacent(tensor_parallel):
    topology = Topology(num_stages=3, num_replicas=2, tensor_parallel=tensor_parallel)
    for replica in range(2):
        for stage in range(3):
            group = topology.tensor_ranks(replica, stage)
            assert group == list(range(group[0], group[0] + tensor_parallel))
            assert group[0] % tensor_parallel == 0  # aligned: a node of t GPUs holds whole stages


def test_one_tensor_parallel_rank_gives_the_same_answers_as_before():
    """t = 1: every rank, coordinate and group as the two-axis topology had them."""
    two_axes, three_axes = Topology(3, 2), Topology(3, 2, tensor_parallel=1)
    assert two_axes == three_axes
    for rank in range(6):
        replica, stage = divmod(rank, 3)
        assert three_axes.coordinates(rank) == (replica, stage, 0)
        assert three_axes.rank(replica, stage) == rank
        assert three_axes.tensor_ranks(replica, stage) == [rank]
    assert three_axes.pipeline_ranks(1) == [3, 4, 5] and three_axes.stage_ranks(2) == [2, 5]


def test_pipeline_peers_share_a_tp_rank():
    topology = Topology(num_stages=2, num_replicas=1, tensor_parallel=2)
    assert topology.coordinates(3) == WorkerCoordinates(replica=0, stage=1, tp_rank=1)
    assert topology.pipeline_ranks(0, tp_rank=1) == [1, 3]  # tp_rank 1 of stage 0 sends to tp_rank 1 of stage 1
    assert topology.stage_ranks(1, tp_rank=1) == [3]
    assert topology.tensor_ranks(0, 1) == [2, 3]


def test_bad_tensor_parallel_sizes_and_indices_are_named():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="^invalid tensor_parallel="):
            Topology(2, 1, tensor_parallel=bad)
    with pytest.raises(IndexError, match="^tp_rank 2 is outside 0..1"):
        Topology(2, 1, 2).rank(0, 0, 2)
    with pytest.raises(IndexError, match="^tp_rank 1 is outside 0..0"):
        Topology(2).pipeline_ranks(0, 1)
    with pytest.raises(IndexError, match="^rank 8 is outside 0..7"):
        Topology(2, 2, 2).coordinates(8)
    with pytest.raises(IndexError, match="^stage 2 is outside 0..1"):
        Topology(2, 1, 2).tensor_ranks(0, 2)


def test_a_failed_workers_place_names_its_tp_rank_only_with_tensor_parallelism():
    from raypipe.errors import WorkersFailed

    assert Topology(2, 2).place(3) == (1, 1)
    assert Topology(2, 2, 2).place(7) == (1, 1, 1)
    assert str(WorkersFailed(4, {Topology(2, 2, 2).place(7): "died", (0, 0, 0): "hung"})) \
        == "step 4: replica 0 stage 0 tp_rank 0 hung, replica 1 stage 1 tp_rank 1 died"
    assert str(WorkersFailed(4, {Topology(2, 2).place(3): "died"})) == "step 4: replica 1 stage 1 died"
