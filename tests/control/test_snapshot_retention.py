"""Which snapshots the driver keeps, without Ray: the one before the newest stays until every
worker's state of the newest is stored. The default executor lets a step commit once its
snapshot is copied and stores it after (each task says when in a small second result), so a
worker that dies after the commit, before its state is stored, takes the newest with it."""
from types import SimpleNamespace

import pytest
import ray

from raypipe.control.snapshots import LoggedStep, Snapshots
from raypipe.executor.base import SnapshotTasks


class Result:
    """A task's result the test finishes by hand: pending, stored, or lost with its worker."""

    def __init__(self) -> None:
        self.ready, self.error = False, None

    def store(self) -> None:
        self.ready = True

    def lose(self) -> None:
        self.ready, self.error = True, ray.exceptions.ActorDiedError()


@pytest.fixture
def fake_results(monkeypatch) -> None:
    def wait(refs: list, num_returns: int = 1, timeout: float | None = None, fetch_local: bool = True):
        return [ref for ref in refs if ref.ready], [ref for ref in refs if not ref.ready]

    def get(refs):
        for ref in refs:
            assert ref.ready, "a pending result was fetched"
            if ref.error is not None:
                raise ref.error
        return [True for _ in refs]

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)


class Executor:
    """Two workers; the first snapshot is stored before the step after it (the state and the
    receipt one result), those taken as a step starts keep their receipts for the test to finish."""

    def __init__(self) -> None:
        self.group = SimpleNamespace(actors=["worker 0", "worker 1"], specs=[SimpleNamespace(layer_indices=(0,)),
                                                                             SimpleNamespace(layer_indices=(1,))])
        self.receipts: list[list[Result]] = []

    def snapshot_workers(self, actors: list) -> SnapshotTasks:
        states = [Result() for _ in actors]
        for state in states:
            state.store()
        return SnapshotTasks(states)

    def wait(self, refs: list) -> None:
        assert all(ref.ready for ref in refs), "a first snapshot is stored before its step"

    def snapshot_with_step(self, actors: list) -> SnapshotTasks:
        """The tasks of a snapshot submitted with the next step (the per-step executor's, over connections)."""
        self.receipts.append([Result() for _ in actors])
        return SnapshotTasks([Result() for _ in actors], list(self.receipts[-1]))


def commit_and_take(snapshots: Snapshots, step: int) -> list[int]:
    """Step ``step`` committed and the next one starts: the steps of the snapshots held then."""
    snapshots.committed(step + 1, LoggedStep(step, None, None))
    if snapshots.due:
        snapshots.keep_due(snapshots.executor.snapshot_with_step(snapshots.executor.group.actors))
    return [snapshot.step for snapshot in snapshots.held]


def test_the_snapshot_before_stays_until_every_worker_stored_the_newest(fake_results):
    executor = Executor()
    snapshots = Snapshots(executor, snapshot_every=1)
    snapshots.take(0, first=True)
    assert commit_and_take(snapshots, 0) == [0, 1]
    # step 1 committed with the snapshot of step 1 copied, not yet stored: the one of step 0 stays
    assert commit_and_take(snapshots, 1) == [0, 1, 2]
    assert [view.whole for view in snapshots.views()] == [True, None, None]
    executor.receipts[0][0].store()  # one worker's part only
    assert commit_and_take(snapshots, 2) == [0, 1, 2, 3]
    executor.receipts[0][1].store()
    executor.receipts[1][0].store()
    assert commit_and_take(snapshots, 3) == [1, 2, 3, 4]
    for receipt in executor.receipts[1] + executor.receipts[2]:
        receipt.store()
    assert commit_and_take(snapshots, 4) == [3, 4, 5]
    assert [view.whole for view in snapshots.views()] == [True, None, None]


def test_a_snapshot_lost_with_a_worker_before_it_was_stored_keeps_the_one_before(fake_results):
    executor = Executor()
    snapshots = Snapshots(executor, snapshot_every=1)
    snapshots.take(0, first=True)
    commit_and_take(snapshots, 0)
    executor.receipts[0][1].store()
    executor.receipts[0][0].lose()  # worker 0 died after step 1 committed, before its state was stored
    assert commit_and_take(snapshots, 1) == [0, 1, 2]
    assert commit_and_take(snapshots, 2) == [0, 1, 2, 3]  # until the heal that follows takes a fresh one
