"""The failure and scaling policies as pure decisions, on fabricated views (no Ray).

Parity: one view per way the heal went (executor/recovery.py before the
policies were taken out of it), each giving the decision that code took; the
expected decisions are written out by hand from it. Plus the re-partition that
counts the running workers' room (issue 41: 4 stages on 4 one-CPU nodes, one
node lost, went to 1 stage while 2 nodes stood idle; 3 stages fit)."""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from raypipe.control import policy
from raypipe.control.policy import (BELOW_MINIMUM, EVERY_COPY_LOST, NO_PARTITION_FITS, NO_ROOM,
                                    NOTHING_TO_HEAL_FROM, TOO_MANY_FAILURES, CopyFromSiblings, Grow,
                                    LoadCheckpoint, Raise, Repartition, ReplaceWorkers, RestoreSnapshot,
                                    ReturnToConfigured, Shrink, Stay, WaitForRoom, decide_failure,
                                    decide_scaling, fits_only_in_place)
from raypipe.control.view import FailedWorker, LayoutView, Room, SnapshotView

SNAPSHOTS = (SnapshotView(4), SnapshotView(5))  # the newest last


def failed(*ranks: int, num_stages: int = 2) -> tuple[FailedWorker, ...]:
    return tuple(FailedWorker(rank, rank // num_stages, rank % num_stages, "died") for rank in ranks)


def view(**facts) -> LayoutView:
    """2 replicas x 2 stages, worker 3 (replica 1 stage 1) failed, snapshots of steps 4 and 5."""
    defaults = dict(num_stages=2, replicas=2, max_replicas=2, failed=failed(3), failures=1, max_failures=3,
                    snapshots=SNAPSHOTS)
    return LayoutView(**{**defaults, **facts})


def reason(decision) -> str:
    assert isinstance(decision, Raise), decision
    return decision.reason


# -- a failure noted (the survivors not asked yet) -------------------------------------
def test_more_failure_events_than_max_failures_raise_too_many_failures():
    assert reason(decide_failure(view(failures=4, max_failures=3))) == TOO_MANY_FAILURES
    assert decide_failure(view(failures=3, max_failures=3)) == ReplaceWorkers((3,))
    assert decide_failure(view(failures=50, max_failures=None)) == ReplaceWorkers((3,))


def test_snapshot_every_0_without_copies_or_checkpoint_raises_when_noted():
    one_replica = view(replicas=1, failed=failed(1), snapshots=(), snapshot_every=0)
    decision = decide_failure(one_replica)
    assert reason(decision) == NOTHING_TO_HEAL_FROM and decision.message.startswith("snapshot_every=0 keeps no")
    zero1 = view(snapshots=(), snapshot_every=0, shard_optimizer=True)  # replicas hold different parts
    assert reason(decide_failure(zero1)) == NOTHING_TO_HEAL_FROM
    # a checkpoint to replay from, or replicas that hold copies: go on
    assert decide_failure(replace(one_replica, checkpoint_step=2)) == ReplaceWorkers((1,))
    assert decide_failure(view(snapshots=(), snapshot_every=0)) == ReplaceWorkers((3,))


# -- the survivors said whether they ended the failed step --------------------------------
def test_snapshot_every_0_with_a_survivor_past_the_step_raises_before_replacing():
    decision = decide_failure(view(snapshots=(), snapshot_every=0, survivors_ended_step=frozenset({0})))
    assert reason(decision) == NOTHING_TO_HEAL_FROM and "a surviving worker had ended the step" in decision.message
    # no sibling of the failed stage left (both replicas lost stage 1)
    assert reason(decide_failure(view(snapshots=(), snapshot_every=0, failed=failed(1, 3),
                                      survivors_ended_step=frozenset()))) == NOTHING_TO_HEAL_FROM
    assert decide_failure(view(snapshots=(), snapshot_every=0, survivors_ended_step=frozenset())) \
        == ReplaceWorkers((3,))
    assert decide_failure(view(survivors_ended_step=frozenset({0}))) == ReplaceWorkers((3,))  # a snapshot heals


# -- the replacements run: where their state comes from -------------------------------------
def test_a_sibling_heals_when_no_survivor_ended_the_step():
    assert decide_failure(view(survivors_ended_step=frozenset(), replaced=True)) == CopyFromSiblings(((3, 1),))
    three = view(replicas=3, failed=failed(0, 5), survivors_ended_step=frozenset(), replaced=True)
    assert decide_failure(three) == CopyFromSiblings(((0, 2), (5, 1)))  # the first survivor of the stage


def test_a_tensor_parallel_ranks_sibling_holds_the_same_shard():
    # 2 replicas x 2 stages x t = 2: rank 7 is replica 1, stage 1, tp_rank 1; rank 3 holds the same shard
    lost = (FailedWorker(7, 1, 1, "died"), FailedWorker(4, 1, 0, "died"))
    split = view(tensor_parallel=2, failed=lost, survivors_ended_step=frozenset(), replaced=True)
    assert decide_failure(split) == CopyFromSiblings(((4, 0), (7, 3)))


@pytest.mark.parametrize("facts", [
    dict(survivors_ended_step=frozenset({2})),  # a survivor ended the step (or did not answer)
    dict(survivors_ended_step=None),  # not asked (one replica, ZeRO-1)
    dict(survivors_ended_step=frozenset(), failed=failed(1, 3)),  # no survivor of stage 1
    dict(survivors_ended_step=frozenset(), shard_optimizer=True),  # ZeRO-1: replicas hold different parts
    dict(survivors_ended_step=frozenset(), replicas=1, failed=failed(1)),
], ids=["ended", "not-asked", "no-sibling", "zero1", "one-replica"])
def test_without_a_sibling_every_worker_restores_the_newest_snapshot(facts):
    assert decide_failure(view(replaced=True, **facts)) == RestoreSnapshot(5)


def test_a_lost_newest_snapshot_falls_back_to_the_older_one():
    lost_newest = (SnapshotView(4), SnapshotView(5, whole=None, kept_off_node=True, lost=True))
    assert decide_failure(view(replaced=True, snapshots=lost_newest)) == RestoreSnapshot(4, older=True)


def test_with_every_snapshot_lost_or_none_kept_the_newest_checkpoint_heals():
    every_lost = tuple(replace(snapshot, lost=True) for snapshot in SNAPSHOTS)
    assert decide_failure(view(replaced=True, snapshots=every_lost, checkpoint_step=3)) == LoadCheckpoint(3)
    assert decide_failure(view(replaced=True, snapshots=(), snapshot_every=0, checkpoint_step=3)) == LoadCheckpoint(3)


def test_with_every_copy_lost_the_heal_raises():
    every_lost = tuple(replace(snapshot, lost=True) for snapshot in SNAPSHOTS)
    assert reason(decide_failure(view(replaced=True, snapshots=every_lost))) == EVERY_COPY_LOST
    assert reason(decide_failure(view(replaced=True, snapshots=every_lost, checkpoint_step=3,
                                      checkpoint_lost=True))) == EVERY_COPY_LOST


# -- a replacement found no room ---------------------------------------------------------
def test_an_elastic_run_shrinks_by_the_replicas_without_room():
    elastic = view(elastic=True, min_replicas=1, max_replicas=3, replicas=3, failed=failed(3, 5))
    assert decide_failure(replace(elastic, unplaced=(3,))) == Shrink(frozenset({1}), 2)
    assert decide_failure(replace(elastic, unplaced=(3, 5))) == Shrink(frozenset({1, 2}), 1)


def test_after_a_shrink_the_state_comes_from_siblings_snapshots_or_a_reshard():
    # worker 3's replica dropped, two replicas left, nothing to copy: the survivors drop the step
    two_left = view(replicas=2, failed=(), shrunk=True, replaced=True, survivors_ended_step=frozenset())
    assert decide_failure(two_left) == CopyFromSiblings(())
    assert decide_failure(replace(two_left, replicas=1, survivors_ended_step=None)) == RestoreSnapshot(5)
    # ZeRO-1: the lost replica's optimizer part moves to new owners, from every old replica's snapshot
    assert decide_failure(replace(two_left, shard_optimizer=True, survivors_ended_step=None)) \
        == RestoreSnapshot(5, reshard=True)


def test_an_elastic_run_that_would_go_below_its_minimum_raises():
    decision = decide_failure(view(elastic=True, min_replicas=2, unplaced=(3,)))
    assert reason(decision) == BELOW_MINIMUM and "fewer than the elastic minimum 2" in decision.message


def test_a_fixed_run_with_a_pipeline_left_or_no_way_to_repartition_raises_no_room():
    assert reason(decide_failure(view(unplaced=(3,), can_repartition=True))) == NO_ROOM  # replica 0 is whole
    assert reason(decide_failure(view(replicas=1, failed=failed(1), unplaced=(1,)))) == NO_ROOM


# -- no whole pipeline left: fewer stages --------------------------------------------------
def four_nodes_one_lost(**facts) -> LayoutView:
    """Issue 41's case: one replica of 4 stages on 4 one-CPU nodes; stage 3's node was lost,
    so its replacement found no room. The 3 survivors hold the other 3 nodes' CPUs."""
    defaults = dict(num_stages=4, replicas=1, max_replicas=1, failed=failed(3, num_stages=4), unplaced=(3,),
                    can_repartition=True, stage_counts_that_fit=(1, 2, 3), room=Room(now=0, with_running_gone=3))
    return view(**{**defaults, **facts})


def test_a_repartition_counts_the_room_the_running_workers_free():
    assert decide_failure(four_nodes_one_lost()) == Repartition(3)  # not 1: the survivors' nodes are free then
    # the room free now alone (one node's CPU freed early) would have given one stage
    assert decide_failure(four_nodes_one_lost(room=Room(now=1, with_running_gone=3))) == Repartition(3)


def test_a_repartition_takes_the_most_stages_the_memory_model_and_the_room_allow():
    assert decide_failure(four_nodes_one_lost(stage_counts_that_fit=(1, 2))) == Repartition(2)  # 3 do not fit
    assert decide_failure(four_nodes_one_lost(room=Room(0, 2))) == Repartition(2)
    # an elastic run with no replica to shrink to re-partitions too
    assert decide_failure(four_nodes_one_lost(elastic=True, min_replicas=1, max_replicas=2)) == Repartition(3)


def test_with_no_partition_fitting_the_room_a_repartition_waits_then_raises():
    waiting = four_nodes_one_lost(stage_counts_that_fit=(), placement_timeout_s=30, waited_for_room_s=1)
    assert decide_failure(waiting) == WaitForRoom(29)
    assert isinstance(decide_failure(four_nodes_one_lost(room=None)), WaitForRoom)  # not measured yet
    decision = decide_failure(replace(waiting, waited_for_room_s=30.5))
    assert reason(decision) == NO_PARTITION_FITS and "room for 3 worker(s)" in decision.message


# -- scaling ------------------------------------------------------------------------
def test_an_elastic_run_grows_by_the_replicas_ready():
    elastic = view(failed=(), replicas=1, min_replicas=1, max_replicas=2, elastic=True)
    assert decide_scaling(replace(elastic, new_replicas_ready=1)) == Grow(1)
    assert decide_scaling(elastic) == Stay()
    assert decide_scaling(replace(elastic, replicas=2, new_replicas_ready=1)) == Stay()  # at its maximum
    assert decide_scaling(replace(elastic, elastic=False, new_replicas_ready=1)) == Stay()


def repartitioned(**facts) -> LayoutView:
    """Re-partitioned from 2 stages onto 1; the configured pipeline fits only in the running room too."""
    defaults = dict(num_stages=1, configured_stages=2, replicas=1, failed=(), room=Room(now=1, with_running_gone=2))
    return view(**{**defaults, **facts})


def test_a_repartitioned_run_returns_beside_once_its_configured_pipeline_is_ready():
    assert decide_scaling(repartitioned(configured_ready_beside=True, configured_started_beside=True)) \
        == ReturnToConfigured(in_place=False)
    assert decide_scaling(repartitioned(configured_started_beside=True)) == Stay()  # started, not ready yet


def test_a_repartitioned_run_returns_in_place_only_where_it_fits_only_there():
    assert decide_scaling(repartitioned()) == ReturnToConfigured(in_place=True)
    assert decide_scaling(repartitioned(room=Room(now=2, with_running_gone=3))) == Stay()  # fits beside: placed soon
    assert decide_scaling(repartitioned(room=Room(now=0, with_running_gone=1))) == Stay()  # fits nowhere yet
    assert decide_scaling(repartitioned(snapshot_every=0)) == Stay()  # the running state would go with them
    assert decide_scaling(repartitioned(return_in_place_allowed=False)) == Stay()  # the room went elsewhere once
    assert decide_scaling(repartitioned(room=None)) == Stay()
    assert decide_scaling(view(failed=(), room=Room(0, 4))) == Stay()  # on its configured stages


def test_fits_only_in_place():
    assert fits_only_in_place(Room(1, 2), 2) and not fits_only_in_place(Room(2, 3), 2)
    assert not fits_only_in_place(Room(0, 1), 2)


def test_the_policies_are_pure():
    """No Ray, no I/O: control/view.py and control/policy.py import only the standard library, each other
    and core's rank arithmetic."""
    allowed = {"__future__", "dataclasses", "raypipe.control.view", "raypipe.core.topology"}
    for module in (policy.__file__, Path(policy.__file__).with_name("view.py")):
        tree = ast.parse(Path(module).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert imported <= allowed, (module, imported - allowed)
