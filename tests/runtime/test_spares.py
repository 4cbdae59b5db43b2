"""Warm spares: the pool's bookkeeping (without Ray), and a heal by a spare with real processes."""
import os
import signal
import threading
import time

import pytest
from torch import nn

import raypipe
from raypipe.runtime.spares import Spare, SparePool
from tests.executor.test_fault_tolerance import STEPS, config, uninterrupted
from tests.executor.test_nonfinite import halving
from tests.reference import adamw, assert_bitwise_equal, checkpoint_state, make_mlp, random_batches


class FakePool(SparePool):
    """The pool's bookkeeping with Ray's calls replaced: placement groups are names,
    a spare is up when the test says so."""

    def __init__(self, count, size=1):
        self.placements, self.killed, self.released, self.up = [], [], [], {}
        super().__init__(actor_class=None, bundle={"CPU": 1.0}, count=count, refill_delay_s=0, size=size)

    def _start(self, location):
        self._numbered += 1
        return Spare(self._numbered - 1, tuple(f"actor {self._numbered - 1}" + "abcdefgh"[rank] * (self.size > 1)
                                               for rank in range(self.size)), location, None)

    def _is_up(self, spare):
        return self.up.get(spare.number)

    def _placement(self, bundles, strategy):
        self.placements.append((f"group {len(self.placements)}", len(bundles), strategy))
        self.bundles = bundles
        return self.placements[-1][0]

    def _kill(self, actor):
        self.killed.append(actor)

    def _release(self, placements):
        self.released += placements


def locations(pool):
    return [spare.location for spare in pool.spares]


def test_spares_start_one_per_bundle_of_their_own_spread_group():
    pool = FakePool(2)
    assert pool.placements == [("group 0", 2, "SPREAD")]
    assert locations(pool) == [("group 0", 0), ("group 0", 1)]
    assert FakePool(0).placements == [] and FakePool(0).spares == []


def test_only_a_spare_that_is_up_is_taken_and_a_new_one_starts_in_the_freed_bundle():
    pool = FakePool(2)
    assert pool.take() is None and pool.up_count() == 0  # none up yet: the heal starts a process as without spares
    pool.up[1] = True
    assert pool.up_count() == 1
    taken = pool.take()
    assert (taken.name, taken.location) == ("spare 1", ("group 0", 1))
    assert [spare.number for spare in pool.spares] == [0]  # not refilled until a bundle is freed
    pool.start_in([("replica group", 3)])  # the failed worker's bundle
    assert [(spare.name, spare.location) for spare in pool.spares] == [("spare 0", ("group 0", 0)),
                                                                        ("spare 2", ("replica group", 3))]


def test_a_new_spare_starts_after_the_refill_delay_and_not_after_shutdown():
    pool = FakePool(1)
    pool._refill_delay_s = 0.05
    pool.up[0] = True
    pool.take()
    pool.start_in([("replica group", 0)])
    assert pool.spares == []  # not while the heal runs
    deadline = time.monotonic() + 10
    while not pool.spares:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert locations(pool) == [("replica group", 0)]
    pool.up[1] = True
    pool.take()
    pool.start_in([("replica group", 1)])
    pool.shutdown()
    time.sleep(0.2)
    assert pool.spares == []


def test_a_spare_that_died_idle_is_dropped_and_another_starts_in_its_bundle():
    pool = FakePool(1)
    pool.up[0] = False
    assert pool.take() is None
    assert [(spare.name, spare.location) for spare in pool.spares] == [("spare 1", ("group 0", 0))]


def test_without_a_free_bundle_a_spare_is_asked_for_wherever_there_is_room():
    pool = FakePool(1)
    pool.up[0] = True
    pool.take()
    pool.refill()  # its bundle went with the worker it became, and none was freed
    assert pool.placements[-1] == ("group 1", 1, "PACK") and locations(pool) == [("group 1", 0)]


def test_at_tensor_parallel_2_a_spare_is_two_processes_in_one_bundle_holding_both():
    pool = FakePool(1, size=2)  # spare_workers=2 at t = 2: one spare, a whole stage's place
    assert pool.placements == [("group 0", 1, "SPREAD")] and pool.bundles == [{"CPU": 2.0}]
    assert [(spare.name, spare.actors, spare.location) for spare in pool.spares] == [
        ("spare 0", ("actor 0a", "actor 0b"), ("group 0", 0))]
    pool.up[0] = False  # one of its processes died idle: the other goes too, and a new group starts there
    assert pool.take() is None and pool.killed == ["actor 0a", "actor 0b"]
    assert [(spare.actors, spare.location) for spare in pool.spares] == [(("actor 1a", "actor 1b"), ("group 0", 0))]


def test_placement_groups_given_up_or_freed_by_their_owner():
    pool = FakePool(2)
    pool.forget(["group 0"])  # e.g. a shut-down group's replica group where spares ran
    assert pool.killed == ["actor 0", "actor 1"] and pool.spares == []
    pool.adopt("replica 1", [0])
    pool.refill()
    assert locations(pool)[0] == ("replica 1", 0) and pool.located_in("replica 1")
    pool.shutdown()
    assert pool.released == ["group 0", "replica 1", pool.placements[-1][0]] and pool.spares == []


@pytest.mark.cluster
def test_a_warm_spare_takes_a_killed_workers_place_and_the_result_changes_no_bit(ray_cluster, tmp_path):
    cfg = config(spare_workers=1)
    expected = uninterrupted(config(), tmp_path)  # spares change no number
    with raypipe.PipelineTrainer(make_mlp(), nn.functional.mse_loss, adamw, cfg, lr_scheduler=halving) as trainer:
        pool = trainer.spares
        assert pool.wait_until_up(120)  # up before the kill (the machine may be slow)
        results = []
        for step, (x, y) in enumerate(random_batches(12, STEPS)):
            if step == 2:
                victim = trainer.workers[1].pid
                threading.Timer(0.01, os.kill, (victim, signal.SIGKILL)).start()
            results.append((lambda result: (result.loss, result.grad_norm))(trainer.step(x, y)))
        (source,) = [recovered.source for recovered in trainer.recoveries]
        assert source.startswith("snapshot of step") and source.endswith(" (replaced by spare 0)"), source
        assert victim not in {worker.pid for worker in trainer.workers}
        # a new spare starts in the killed worker's bundle (a little after the heal), and comes up
        assert pool.wait_until_up(120)
        assert [spare.name for spare in pool.spares] == ["spare 1"]
        state = checkpoint_state(trainer, tmp_path / "spare", len(make_mlp()))
    assert results == expected.results
    assert_bitwise_equal(expected.state, state)



def group_with(where, spares):
    """A StageGroup's bundle bookkeeping alone (no Ray): where each worker runs, and its pool."""
    from raypipe.runtime.group import StageGroup

    group = object.__new__(StageGroup)
    group._where, group.spares = list(where), spares
    return group


def test_dropping_a_replica_frees_its_group_unless_a_spare_or_a_kept_worker_runs_there(monkeypatch):
    from raypipe.runtime import cluster

    released = []
    monkeypatch.setattr(cluster, "release", released.extend)
    pool = FakePool(1)  # its spare 0 runs in ("group 0", 0)
    pool.up[0] = True
    pool.take()  # replica 1's stage 0 took it...
    pool.start_in([("replica 1", 0)])  # ...and spare 1 started in the bundle it left
    # ranks: replica 0 stages 0 and 1, replica 1 stages 0 (in the spare's bundle) and 1
    group = group_with([("replica 0", 0), ("replica 0", 1), ("group 0", 0), ("replica 1", 1)], pool)
    group._give_up(["replica 1"], kept=[0, 1], dropped=[2, 3])
    assert released == []  # spare 1 runs in replica 1's group: the pool keeps it, and frees it at its end
    assert pool._owned[-1] == "replica 1" and ("replica 1", 1) in pool._free
    assert ("group 0", 0) in pool._free  # the dropped worker's bundle in the pool's group is the pool's again

    pool = FakePool(0)
    group = group_with([("replica 0", 0), ("replica 1", 0), ("replica 1", 1), ("replica 2", 0)], pool)
    group._give_up(["replica 1", "replica 2"], kept=[0, 1], dropped=[2, 3])  # rank 1 runs in replica 1's bundle 0
    assert released == ["replica 2"] and pool._owned == ["replica 1"]


def test_at_tensor_parallel_2_a_dropped_stage_frees_its_one_bundle_once(monkeypatch):
    from raypipe.runtime import cluster

    monkeypatch.setattr(cluster, "release", lambda placements: None)
    pool = FakePool(1, size=2)  # spare 0: a group of two in ("group 0", 0)
    pool.up[0] = True
    pool.take()  # replica 1's stage 0 took it (both of its ranks)...
    pool.start_in([("replica 1", 0)])  # ...and spare 1 started in the bundle the stage left
    # ranks: replica 0 stage 0 tp_ranks 0, 1; replica 1 stage 0 tp_ranks 0, 1 (in the spare's bundle)
    group = group_with([("replica 0", 0), ("replica 0", 0), ("group 0", 0), ("group 0", 0)], pool)
    group._give_up(["replica 1"], kept=[0, 1], dropped=[2, 3])
    assert pool._free == [("group 0", 0)]  # the stage's bundle, once: a group of two starts there, not two
