"""Replicas spread over nodes where there is room, and start as before where
there is not (a multi-node ``ray.cluster_utils.Cluster`` in a subprocess, see
spread_run.py: a 16-CPU node and a 4-CPU node, replicas of two 1-CPU stages)."""
import pytest

from tests.executor.cluster_run import run_in_subprocess
from tests.reference import assert_mlp_run_matches_one_process


def nodes_by_replica(workers: list) -> dict[int, set[str]]:
    """Each replica's nodes, from ``WorkerInfo(replica, stage, node_id, pid, tp_rank)`` tuples."""
    nodes: dict[int, set[str]] = {}
    for replica, _, node_id, *_ in workers:
        nodes.setdefault(replica, set()).add(node_id)
    return nodes


@pytest.mark.cluster
def test_replicas_spread_over_nodes_with_room_and_pack_where_only_one_has_it(tmp_path):
    run = run_in_subprocess("tests.runtime.spread_run", tmp_path / "spread.json", timeout_s=300)
    big, small = run["big"], run["small"]

    spread = run["spread"]  # Ray's PACK alone puts both replicas on the big node
    assert nodes_by_replica(spread["workers_at_start"]) == {0: {big}, 1: {small}}  # a node each, stages together
    assert_mlp_run_matches_one_process(spread["losses"], spread["state"], 8, 4)

    full = run["one_node_full"]  # the small node has no room: both replicas on the big one, without waiting
    assert nodes_by_replica(full["workers_at_start"]) == {0: {big}, 1: {big}}
    assert run["reserve_seconds_one_node_full"] < 5, run["reserve_seconds_one_node_full"]
    assert full["start_seconds"] < spread["start_seconds"] + 15, (full["start_seconds"], spread["start_seconds"])
    assert_mlp_run_matches_one_process(full["losses"], full["state"], 8, 4)

    grow = run["grow"]  # the replica asked for was placed beside the running one, and moved to the free node
    assert nodes_by_replica(grow["workers_at_start"]) == {0: {big}}
    assert grow["nodes_of_the_runs_groups_before_the_small_node_frees"] == [big]
    assert nodes_by_replica(grow["workers_at_end"]) == {0: {big}, 1: {small}}
    assert grow["num_replicas"][0] == 1 and grow["num_replicas"][-1] == 2
    assert_mlp_run_matches_one_process(grow["losses"], grow["state"], 8, 4)

    assert set(run["groups_left"]) == {"REMOVED"}  # every group asked for (moved ones too) was freed
    print(f"start with 2 replicas spread: {spread['start_seconds']:.1f} s; on one node: "
          f"{full['start_seconds']:.1f} s (reservation {run['reserve_seconds_one_node_full']:.2f} s)")
