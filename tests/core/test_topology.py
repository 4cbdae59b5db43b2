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
